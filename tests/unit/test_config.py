"""Config loading: valid files, overrides, and one clear line for every kind of bad input."""

from pathlib import Path

import pytest

from scaleout.api import load_config
from scaleout.cli import main
from scaleout.errors import ConfigError
from scaleout.nn.config import MLPModel

REPO = Path(__file__).resolve().parents[2]

GOOD = """
[run]
name = "t"
[data]
dataset = "mnist"
[model]
kind = "mlp"
sizes = [784, 32, 10]
[train]
lr = 0.1
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_shipped_configs_validate():
    for path in sorted((REPO / "configs").glob("*.toml")):
        assert load_config(path).run.name


def test_defaults_and_types(tmp_path):
    config = load_config(write(tmp_path, GOOD))
    assert isinstance(config.model, MLPModel)
    assert config.train.lr == 0.1 and config.train.strategy == "single"
    assert config.run.out_dir == Path("runs") and config.run_dir == Path("runs/t")
    assert config.train.steps is None and config.loader.workers == 0


def test_overrides_parse_toml_values(tmp_path):
    config = load_config(
        write(tmp_path, GOOD),
        ["train.steps=7", "train.optimizer=adagrad", "model.sizes=[784, 10]", "run.name='x'"],
    )
    assert config.train.steps == 7 and config.train.optimizer == "adagrad"
    assert config.model.sizes == [784, 10] and config.run.name == "x"


@pytest.mark.parametrize(
    ("text", "overrides", "expected"),
    [
        (GOOD.replace("lr = 0.1", "lr = "), [], "invalid TOML"),
        (GOOD + "bogus = 1\n", [], "train.bogus: unknown key (allowed in [train]: strategy"),
        (GOOD.replace("[run]", "[rnu]"), [], "rnu: unknown key (allowed in the top level: run"),
        (
            GOOD.replace("lr = 0.1", 'lr = "fast"'),
            [],
            "train.lr = 'fast': Input should be a valid number",
        ),
        (
            GOOD.replace("lr = 0.1", "lr = -0.1"),
            [],
            "train.lr = -0.1: Input should be greater than 0",
        ),
        (
            GOOD,
            ["train.optimizer=lamb"],
            "train.optimizer = 'lamb': 'lamb' is not an optimizer: use one of sgd, momentum",
        ),
        (GOOD, ["data.path='/no/such/dir'"], "data.path /no/such/dir is not an existing directory"),
        (GOOD, ["model.sizes=[784]"], "model.sizes = [784]: List should have at least 2 items"),
        (GOOD, ["model.dropout=[0.1]"], "model = "),
        (GOOD, ["model.kind=cnn"], "model.kind = 'cnn': expected one of 'mlp', 'speech_dnn'"),
        (GOOD, ["model.extra=1"], "model.extra: unknown key (allowed in [model]: kind, sizes"),
        (GOOD.replace('dataset = "mnist"', ""), [], "data.dataset = missing: expected one of"),
        (GOOD, ["run.device=tpu"], "run.device = 'tpu': String should match pattern"),
        (GOOD, ["nonsense"], "--set 'nonsense': expected key.path=value"),
        (GOOD, ["data.path=3", "data.dataset=npz"], "data.path = 3: Input is not a valid path"),
    ],
)
def test_bad_config_is_one_clear_line(tmp_path, capsys, text, overrides, expected):
    path = write(tmp_path, text)
    argv = ["info", str(path)] + [arg for o in overrides for arg in ("--set", o)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    prefix = "error: " if expected.startswith("--set") else f"error: {path}: "
    assert lines[0].startswith(prefix), lines[0]
    assert expected in lines[0], lines[0]
    assert "Traceback" not in captured.err


def test_missing_default_data_names_the_fix(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SCALEOUT_DATA", raising=False)
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, GOOD.replace('"mnist"', '"fashion_mnist"'))
    assert main(["info", str(path)]) == 2
    err = capsys.readouterr().err
    assert "cannot find the fashion_mnist data set" in err and "set data.path or" in err


def test_missing_config_file(tmp_path, capsys):
    assert main(["train", str(tmp_path / "absent.toml")]) == 2
    assert "no such config file" in capsys.readouterr().err


def test_several_errors_one_line_each(tmp_path):
    path = write(tmp_path, GOOD.replace("lr = 0.1", "lr = -1\nepochs = 0"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    lines = str(info.value).splitlines()
    assert len(lines) == 2
    assert any("train.lr = -1" in line for line in lines)
    assert any("train.epochs = 0" in line for line in lines)
