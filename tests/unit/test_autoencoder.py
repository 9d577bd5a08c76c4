"""The sparse autoencoder: eq. 1 against a dense from-scratch computation, gradients against
finite differences, descent on real whitened patches, greedy training through `scaleout
train` (resume included), the paper configurations' counts, and neuron selectivity."""

import json
import math
from pathlib import Path

import pytest
import torch

from scaleout.api import load_config, prepare
from scaleout.cli import main
from scaleout.data import natural_image_patches
from scaleout.data.faces import face_dataset
from scaleout.info import describe_model
from scaleout.metrics import read_metrics
from scaleout.nn import MODELS, SparseAutoencoderNetwork, SparseAutoencoderStack, build_model
from scaleout.nn.autoencoder import tied_autoencode, write_filter_image
from scaleout.nn.local import LocalGeometry, kernels
from scaleout.nn.selectivity import best_threshold_accuracy
from scaleout.reports import selectivity_report
from scaleout.rundir import RunDir
from scaleout.train import driver
from tests.run_config import config_file
from tests.stop_when import stop_when

pytestmark = pytest.mark.usefixtures("one_thread")


CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def naive_codes(x, weight, g):
    """W x by a loop over block positions, W = weight with unit-norm rows."""
    w = weight / weight.norm(dim=-1, keepdim=True)
    n, rows = x.shape[0], []
    for r in range(g.positions_h):
        cols = []
        for c in range(g.positions_w):
            patch = x[:, :, r * g.step : r * g.step + g.field, c * g.step : c * g.step + g.field]
            y = patch.permute(0, 2, 3, 1).reshape(n, -1) @ w[r, c].T
            cols.append(y.view(n, g.block_height, g.block_width, g.depth).permute(0, 3, 1, 2))
        rows.append(torch.cat(cols, dim=3))
    return torch.cat(rows, dim=2)


def dense_objective(x, weight, alpha, g, pool, lam, eps):
    """Eq. 1 per example from a dense W built column by column, explicit pooling windows."""
    n, d_in = x.shape[0], math.prod(g.in_shape)
    basis = torch.eye(d_in, dtype=x.dtype).view(d_in, *g.in_shape)
    dense = naive_codes(basis, weight, g).reshape(d_in, -1).T  # (D_out, D_in)
    codes = alpha * x.reshape(n, -1) @ dense.T  # (N, D_out)
    recon = codes @ dense
    covered = (dense != 0).any(dim=0)  # pixels some field reads
    reconstruction = ((recon - x.reshape(n, -1)) ** 2 * covered).sum() / n
    h = codes.view(n, *g.out_shape)
    size, stride, pad = pool
    padded = torch.nn.functional.pad(h, (pad, pad, pad, pad))
    total = 0.0
    for i in range(0, padded.shape[2] - size + 1, stride):
        for j in range(0, padded.shape[3] - size + 1, stride):
            window = padded[:, :, i : i + size, j : j + size]
            total = total + torch.sqrt(eps + (window**2).sum(dim=(2, 3))).sum()
    return reconstruction, lam * total / n


GEOMETRIES = [
    # (C, size, field, step, block, pool size, pool padding)
    (2, 9, 3, 2, (2, 2, 2), 3, 0),  # overlapping fields
    (1, 10, 4, 5, (1, 2, 3), 3, 1),  # gaps between fields: uncovered pixels
    (3, 7, 3, 1, (1, 1, 2), 2, 1),
]


def make_stack(c, size, field, step, block, pool, pad, lam=0.1):
    torch.manual_seed(0)
    stack = SparseAutoencoderStack(
        c, size, field, step, block, pool_size=pool, pool_padding=pad, sparsity_weight=lam
    ).double()
    with torch.no_grad():
        stack.alpha.fill_(0.7)
    return stack


@pytest.fixture(params=[False, True], ids=["via-temporary", "in-place"])
def transpose_path(request, monkeypatch):
    """W^T y accumulated in place or through a temporary, whatever the field size."""
    monkeypatch.setattr(kernels, "DIRECT_ADD_MIN_ROWS", 0 if request.param else 1 << 30)


@pytest.mark.parametrize("spec", GEOMETRIES)
def test_objective_equals_dense_computation(spec, transpose_path):
    stack = make_stack(*spec)
    g = stack.geometry
    x = torch.randn(3, *g.in_shape, dtype=torch.float64)
    terms = stack.objective(x)
    reconstruction, sparsity = dense_objective(
        x, stack.filter.weight.detach(), 0.7, g, (spec[5], 1, spec[6]), 0.1, stack.pool.eps
    )
    torch.testing.assert_close(terms.reconstruction, reconstruction)
    torch.testing.assert_close(terms.sparsity, sparsity)
    # the generic layers through autograd give the same values and gradients
    reference = stack.objective_reference(x)
    torch.testing.assert_close(reference.total, terms.total)
    params = (stack.filter.weight, stack.alpha)
    for ours, theirs in zip(
        torch.autograd.grad(terms.total, params),
        torch.autograd.grad(reference.total, params),
        strict=True,
    ):
        torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("spec", GEOMETRIES[:2])
def test_gradient_matches_finite_differences(spec, transpose_path):
    stack = make_stack(*spec)
    g = stack.geometry
    x = torch.randn(2, *g.in_shape, dtype=torch.float64, requires_grad=True)
    weight = stack.filter.weight.detach().clone().requires_grad_()
    alpha = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)

    def objective(x, weight, alpha):
        codes, recon = tied_autoencode(x, weight, alpha, g)
        return stack._terms(x, codes, recon).total

    assert torch.autograd.gradcheck(objective, (x, weight, alpha))
    assert torch.autograd.gradcheck(lambda *a: tied_autoencode(*a, g), (x, weight, alpha))


@pytest.mark.parametrize("spec", GEOMETRIES[:2])
def test_objective_and_features_equal_objective_and_forward(spec):
    """One pass gives what `objective` and `forward` give apart, values and gradients."""
    stack = make_stack(*spec)
    x = torch.randn(3, *stack.geometry.in_shape, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(stack(x).shape, dtype=torch.float64)

    def gradients(loss: torch.Tensor) -> list[torch.Tensor]:
        return torch.autograd.grad(loss, [x, stack.filter.weight, stack.alpha])

    terms, features = stack.objective_and_features(x)
    apart_terms, apart_features = stack.objective(x), stack(x)
    torch.testing.assert_close(torch.stack(terms), torch.stack(apart_terms))
    torch.testing.assert_close(features, apart_features)
    one_pass = gradients(terms.total + (features * probe).sum())
    two_passes = gradients(apart_terms.total + (apart_features * probe).sum())
    for ours, theirs in zip(one_pass, two_passes, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_fit_alpha_minimises_the_reconstruction_over_alpha():
    stack = make_stack(*GEOMETRIES[1])  # with uncovered pixels
    x = torch.randn(4, *stack.geometry.in_shape, dtype=torch.float64)
    best = stack.fit_alpha_(x)

    def reconstruction(alpha):
        with torch.no_grad():
            stack.alpha.fill_(alpha)
            return stack.objective(x).reconstruction.item()

    assert reconstruction(best) < min(reconstruction(best * 0.99), reconstruction(best * 1.01))


def test_objective_decreases_on_whitened_patches():
    torch.manual_seed(0)
    patches = natural_image_patches(16, 3000, seed=0).x
    train, test = patches[:2500], patches[2500:]
    net = SparseAutoencoderNetwork(1, 16, 1, field=8, step=4, block=(2, 2, 8), pool_size=3)
    net.train_only(0)
    optimizer = torch.optim.SGD(net.stack_parameter_groups(0, 0.01), lr=0.01, momentum=0.9)
    with torch.no_grad():
        before = net.stack_objective(test, 0)
    for _ in range(150):
        x = train[torch.randint(0, len(train), (64,))]
        terms = net.stack_objective(x, 0)
        optimizer.zero_grad()
        terms.total.backward()
        optimizer.step()
    with torch.no_grad():
        after = net.stack_objective(test, 0)
    assert after.total < 0.5 * before.total, (before, after)
    assert after.reconstruction < before.reconstruction


def test_greedy_training_touches_only_the_stack_in_training():
    torch.manual_seed(0)
    net = SparseAutoencoderNetwork(
        1, 20, 2, field=[6, 4], step=[2, 2], block=(2, 2, 3), pool_size=3
    )
    x = torch.randn(4, 1, 20, 20)
    frozen = net.stacks[0].filter.weight.detach().clone()
    net.train_only(1)
    optimizer = torch.optim.SGD(net.stack_parameters(1), lr=0.01, momentum=0.9)
    terms = net.stack_objective(x, 1)
    torch.testing.assert_close(terms.total, net.stacks[1].objective(net.stacks[0](x)).total)
    terms.total.backward()
    optimizer.step()
    assert net.stacks[0].filter.weight.grad is None
    torch.testing.assert_close(net.stacks[0].filter.weight, frozen)
    assert net.stacks[1].filter.weight.grad is not None


def test_network_shapes_per_stack_options_and_errors():
    net = SparseAutoencoderNetwork(
        3, 24, 2, field=[8, 4], step=[4, 1], block=[[2, 2, 4], [1, 1, 5]], pool_size=[3, 2]
    )
    # stack 1: (24-8)//4+1 = 5 positions -> 10 -> pool 3 -> 8; stack 2: 8-4+1 = 5 -> 5 -> 4
    assert net.stacks[0].out_shape == (4, 8, 8)
    assert net.output_shape == (5, 4, 4)
    assert net(torch.randn(2, 3, 24, 24)).shape == (2, 5, 4, 4)
    assert "sparse_autoencoder" in MODELS
    with pytest.raises(ValueError, match="model.field"):
        SparseAutoencoderNetwork(1, 16, 2, field=[8, 9], step=4, block=(2, 2, 2), pool_size=3)
    with pytest.raises(ValueError, match="model.step has 3 values for 2 stacks"):
        SparseAutoencoderNetwork(1, 16, 2, field=4, step=[4, 4, 4])


def test_filter_image(tmp_path):
    g = LocalGeometry(3, 12, 12, 5, 1, 2, 2, 3)
    path = write_filter_image(torch.randn(g.weight_shape), g, tmp_path / "f.png")
    import matplotlib.image

    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 5 and image.shape[1] > 5


def test_best_threshold_accuracy_matches_brute_force():
    torch.manual_seed(0)
    responses = torch.randint(0, 6, (30, 7)).float()  # many ties
    labels = torch.randint(0, 2, (30,))
    accuracy, threshold = best_threshold_accuracy(responses, labels)
    for d in range(7):
        values = sorted(set(responses[:, d].tolist()))
        candidates = (
            [values[0] - 1]
            + [(a + b) / 2 for a, b in zip(values, values[1:], strict=False)]
            + [values[-1]]
        )
        best = max(
            ((responses[:, d] > t).long() == labels).float().mean().item() for t in candidates
        )
        assert accuracy[d].item() == pytest.approx(best)
        realised = ((responses[:, d] > threshold[d]).long() == labels).float().mean().item()
        assert realised == pytest.approx(best)


def test_face_dataset():
    images, labels = face_dataset(32, channels=3)
    assert images.shape == (200, 3, 32, 32) and labels.sum() == 100
    assert images[:, 0].std(dim=(1, 2)).mean() == pytest.approx(1.0, abs=1e-3)


# --- paper configurations --------------------------------------------------------------------


def test_paper_configurations_counts():
    small = describe_model(load_config(CONFIGS / "autoencoder_1.8b.toml"))
    filters = [layer.params for layer in small.layers if layer.kind == "LocallyConnected2d"]
    # valid filters, valid 5x5 stride-1 pooling: 200 -> 46 positions -> 184 -> 180 -> 41 ...
    assert filters == [46**2 * 128 * 1200, 41**2 * 128 * 3200, 36**2 * 128 * 3200]
    assert small.params == sum(filters) + 3 == 1_544_396_803  # paper: about 1.8 billion
    assert small.layers[0].flops == 2 * filters[0]
    large = describe_model(load_config(CONFIGS / "autoencoder_11b.toml"))
    filters = [layer.params for layer in large.layers if layer.kind == "LocallyConnected2d"]
    assert filters == [46**2 * 288 * 1200, 38**2 * 288 * 32 * 32 * 18, 30**2 * 288 * 32 * 32 * 18]
    assert abs(large.params / 11.2e9 - 1) < 0.2 and abs(small.params / 1.8e9 - 1) < 0.2
    assert any("stack 2" in note for note in small.notes)


def test_small_config_builds():
    config = load_config(CONFIGS / "autoencoder_small.toml")
    model = build_model(config.model.kind, **config.model.model_dump(exclude={"kind"}))
    assert tuple(model.input_shape) == (
        config.model.in_channels,
        config.data.patch_size,
        config.data.patch_size,
    )


# --- scaleout train: greedy, resumable -------------------------------------------------------


def write_config(tmp_path, name):
    return config_file(
        tmp_path,
        name,
        run={"seed": 1},
        data={
            "dataset": "patches",
            "patch_size": 16,
            "num_train": 256,
            "num_test": 64,
            "images": ["camera", "grass"],
        },
        model={
            "kind": "sparse_autoencoder",
            "in_channels": 1,
            "in_size": 16,
            "num_stacks": 2,
            "field": [6, 4],
            "step": 2,
            "block": [2, 2, 4],
            "pool_size": 3,
        },
        train={
            "steps": 6,
            "batch_size": 32,
            "optimizer": "momentum",
            "lr": 0.005,
            "eval_every": 4,
            "log_every": 2,
            "checkpoint_every": 4,
        },
    )


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("greedy")
    assert main(["train", str(write_config(tmp_path, "full"))]) == 0
    return tmp_path / "runs" / "full"


def test_train_logs_both_terms_per_stack(trained_run):
    records = read_metrics(trained_run / "metrics.jsonl")
    assert [r["step"] for r in records] == [2, 4, 6, 8, 10, 12]
    assert [r["stack"] for r in records] == [1, 1, 1, 2, 2, 2]
    for r in records:
        assert r["loss"] == pytest.approx(r["reconstruction"] + r["sparsity"])
        assert r["reconstruction"] > 0 and r["sparsity"] > 0
    assert {"test_reconstruction", "test_sparsity"} <= set(records[-1])
    for name in ("filters.png", "objective.png", "metrics.png"):
        assert (trained_run / name).is_file()


def test_resume_ends_where_an_uninterrupted_run_ends(tmp_path, trained_run, monkeypatch):
    """Stop part-way through stack 2 (as Ctrl-C would), resume: the weights end up exactly
    those of the uninterrupted run."""

    path = write_config(tmp_path, "resumed")
    config = load_config(path)
    first = prepare(path)
    monkeypatch.setattr(
        driver,
        "StopOnInterrupt",
        stop_when(lambda: first.strategy.step >= 8),  # mid-stack-2
    )
    result = first.train()
    assert result.interrupted and result.step == 8
    monkeypatch.undo()
    second = prepare(path, resume=True).train()
    assert second.step == 12 and not second.interrupted
    ours = RunDir(config.run_dir).checkpoints
    theirs = RunDir(trained_run).checkpoints
    from scaleout.checkpoint import load_checkpoint

    a, _ = load_checkpoint(ours.latest())
    b, _ = load_checkpoint(theirs.latest())
    for key in b:
        if key.startswith("model."):
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def test_selectivity_report(trained_run):
    report = selectivity_report(trained_run)
    assert report["num_faces"] == report["num_nonfaces"] == 100
    assert report["chance"] == 0.5
    for which in ("trained", "random"):
        numbers = report[which]
        assert 0.5 <= numbers["best_accuracy"] <= 1
        assert 0 <= numbers["heldout_accuracy"] <= 1
        assert numbers["num_neurons"] == 4 * 6 * 6  # 16 -> 6 positions -> 12 -> 10 -> 4 -> 8 -> 6
    json.dumps(report)  # plain numbers, printable by the CLI
