"""scaleout.fit and the factories: dict and TOML configs, models and data defined by the user
(also in a script that cannot be imported), every bad factory as one line and exit 2, and
TensorBoard event files."""

import json
import subprocess
import sys
import textwrap

import pytest

USER_SCRIPT = '''
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import scaleout


class Classifier(nn.Module):
    """Defined in this script only: workers get it by value."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU())
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        return self.head(self.body(x))


def build_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 8, generator=g)
    y = (x @ torch.randn(8, 3, generator=g)).argmax(dim=1)
    return TensorDataset(x[:1536], y[:1536]), TensorDataset(x[1536:], y[1536:])


if __name__ == "__main__":
    out, strategy = sys.argv[1], sys.argv[2]
    result = scaleout.fit(
        {
            "run": {"name": strategy, "out_dir": out, "device": "cpu", "num_threads": 1},
            "train": {"strategy": strategy, "steps": 80, "batch_size": 32, "optimizer": "adam",
                      "lr": 0.01, "eval_every": 40},
            "downpour": {"num_replicas": 2, "num_shards": 2},
            "sync": {"num_workers": 2},
        },
        model=Classifier,
        data=build_data,
    )
    print("ACCURACY", result.final_test_accuracy)
'''


@pytest.mark.parametrize("strategy", ["downpour", pytest.param("sync", marks=pytest.mark.slow)])
def test_model_in_a_users_script_trains_on_ray_workers(tmp_path, strategy):
    """A model and data defined in a script that cannot be imported (its file name is not a
    module name, and it runs from another directory): Ray's workers get them by value."""
    script = tmp_path / "scripts" / "my-training-script.py"
    script.parent.mkdir()
    script.write_text(textwrap.dedent(USER_SCRIPT))
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "runs"), strategy],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    accuracy = float(proc.stdout.split("ACCURACY")[-1])
    assert accuracy >= 0.85, proc.stdout
    recorded = json.loads((tmp_path / "runs" / strategy / "config.json").read_text())
    assert recorded["model"]["factory"] == "__main__:Classifier"
