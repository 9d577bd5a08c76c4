"""Parameter server: sharded optimizers against torch.optim on the whole vector, flat
parameter views, shard checkpoints, and shards restarted by Ray."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.optim.lr_scheduler import LambdaLR

from scaleout.compress import CompressSection
from scaleout.nn.optim import DEFAULT_WARMUP
from scaleout.ps import FlatParameters, ParameterShard, Wire, shard_ranges
from scaleout.train.config import TrainSection


@given(num_values=st.integers(1, 10_000), num_shards=st.integers(1, 16))
def test_shard_ranges_tile_the_vector(num_values, num_shards):
    if num_shards > num_values:
        with pytest.raises(ValueError, match="num_shards"):
            shard_ranges(num_values, num_shards)
        return
    ranges = shard_ranges(num_values, num_shards)
    assert ranges[0][0] == 0 and ranges[-1][1] == num_values
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    sizes = [stop - start for start, stop in ranges]
    assert max(sizes) - min(sizes) <= 1


def small_model():
    torch.manual_seed(0)
    # 5*3+3 + 3*4+4 = 34 values: shard borders for S = 2, 3 fall inside parameters.
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 4))


def test_flat_parameters_are_views_and_gradients_accumulate():
    model = small_model()
    reference = [p.detach().clone() for p in model.parameters()]
    flat = FlatParameters(model)
    assert flat.numel == 34
    for p, r in zip(model.parameters(), reference, strict=True):
        assert torch.equal(p, r)
    flat.params.add_(1.0)  # writing the buffer changes the model
    assert torch.equal(next(model.parameters()), reference[0] + 1)
    x = torch.randn(8, 5)
    model(x).sum().backward()
    once = flat.grads.clone()
    model(x).sum().backward()
    torch.testing.assert_close(flat.grads, 2 * once)  # accumulated in place
    flat.zero_grads()
    assert flat.grads.abs().sum() == 0


def make_shards(initial, num_shards, optimizer, **checkpoint):
    train = TrainSection(optimizer=optimizer, lr=0.1, momentum=0.9)
    shards = []
    for i, (start, stop) in enumerate(shard_ranges(initial.numel(), num_shards)):
        shard = ParameterShard(i, stop - start, train, **checkpoint)
        shard.initialize(initial[start:stop].numpy())
        shards.append((shard, start, stop))
    return shards


@pytest.mark.parametrize("num_shards", [1, 2, 3])
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adagrad", "rmsprop", "adam"])
def test_sharded_optimizer_equals_torch_optim_on_whole_vector(num_shards, optimizer):
    initial = torch.randn(34, generator=torch.Generator().manual_seed(1))
    whole = torch.nn.Parameter(initial.clone())
    kinds = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
        "momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        # fused, as `build_optimizer` steps them on the CPU (the unfused step differs by an ulp)
        "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, fused=True),
        "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.1),
        "adam": lambda p: torch.optim.Adam(p, lr=0.1, fused=True),
    }
    reference = kinds[optimizer]([whole])
    warmup = DEFAULT_WARMUP.get(optimizer, 0)  # torch's own scheduler as the reference
    schedule = LambdaLR(reference, lambda k: min(1.0, (k + 1) / warmup)) if warmup else None
    shards = make_shards(initial, num_shards, optimizer)
    wire = Wire()
    g = torch.Generator().manual_seed(2)
    for step in range(7):
        grad = torch.randn(34, generator=g)
        whole.grad = grad.clone()
        reference.step()
        if schedule is not None:
            schedule.step()
        for shard, start, stop in shards:
            applied = shard.push(wire.encode(grad[start:stop]), base_version=step)
            assert applied == (step + 1, 0, 1.0)
    sharded = torch.cat([torch.as_tensor(shard.values()) for shard, _, _ in shards])
    torch.testing.assert_close(sharded, whole.detach(), rtol=1e-6, atol=1e-7)


def test_staleness_counts_updates_since_fetch():
    ((shard, _, _),) = make_shards(torch.zeros(4), 1, "sgd")
    wire = Wire()
    _, fetched = shard.pull()
    for _ in range(3):
        shard.push(wire.encode(torch.ones(4)), base_version=fetched)
    assert shard.push(wire.encode(torch.ones(4)), base_version=fetched) == (4, 3, 1.0)


def test_shard_checkpoint_restores_and_continues_identically(tmp_path):
    initial = torch.randn(20, generator=torch.Generator().manual_seed(3))
    grads = torch.randn(10, 20, generator=torch.Generator().manual_seed(4))
    wire = Wire()
    options = dict(checkpoint_dir=str(tmp_path / "s0"), checkpoint_every=4)
    ((shard, _, _),) = make_shards(initial, 1, "adagrad", **options)
    ((straight, _, _),) = make_shards(initial, 1, "adagrad")
    for step in range(6):
        shard.push(wire.encode(grads[step]), step)
        straight.push(wire.encode(grads[step]), step)
    # A new process for the same shard: it comes back at its last checkpoint (version 4) ...
    ((restarted, _, _),) = make_shards(initial, 1, "adagrad", **options)
    assert restarted.info()["restored_version"] == 4 and restarted.version == 4
    # ... and replaying the updates it lost gives exactly the uninterrupted shard.
    for step in range(4, 10):
        restarted.push(wire.encode(grads[step]), step)
        if step >= 6:
            straight.push(wire.encode(grads[step]), step)
    assert torch.equal(torch.as_tensor(restarted.values()), torch.as_tensor(straight.values()))


def test_shard_refuses_wrong_gradient_size():
    ((shard, _, _),) = make_shards(torch.zeros(4), 1, "sgd")
    with pytest.raises(ValueError, match="holds 4 values"):
        shard.push(Wire().encode(torch.ones(5)), 0)


@pytest.mark.parametrize("codec", ["dynamic8", "linear8"])
def test_compressed_pushes_shrink_bytes_and_track_fp32(codec):
    """8-bit gradient pushes (with error feedback) move ~4x fewer bytes and, summed over
    steps, apply nearly the fp32 updates."""
    initial = torch.zeros(4096)
    grads = torch.randn(20, 4096, generator=torch.Generator().manual_seed(5))
    compress = CompressSection(codec=codec, block_size=256, error_feedback=True)
    (exact,) = make_shards(initial, 1, "sgd")
    packed = ParameterShard(0, 4096, TrainSection(optimizer="sgd", lr=0.1), compress)
    packed.initialize(initial.numpy())
    plain, wire = Wire(), Wire(compress)
    for step, grad in enumerate(grads):
        exact[0].push(plain.encode(grad), step)
        payload = wire.encode(grad, key=0)
        assert isinstance(payload, bytes) and len(payload) < 4096 * 4 / 3.5
        packed.push(payload, step)
    sgd = torch.as_tensor(exact[0].values())
    drift = (torch.as_tensor(packed.values()) - sgd).abs().max() / sgd.abs().max()
    assert drift < 0.01  # error feedback: only the last residual is missing


def test_shard_nodes_are_the_alive_ones_the_callers_first(monkeypatch):
    """With backups, primary i goes to node i mod N of these (the caller's node first, as
    `scaleout simulate` places shard i on machine i mod N); dead nodes and nodes without
    the shards' resource are left out."""
    import ray

    from scaleout.ps.backup import shard_nodes

    def node(node_id, address, alive=True, **resources):
        return {
            "NodeID": node_id,
            "NodeManagerAddress": address,
            "Alive": alive,
            "Resources": {"CPU": 1.0, **resources},
        }

    a, b, c, dead = (letter * 56 for letter in "abcd")  # node IDs: 28 bytes in hex
    nodes = [
        node(c, "10.0.0.3"),
        node(b, "10.0.0.1", ps=100.0),
        node(dead, "10.0.0.0", alive=False),
        node(a, "10.0.0.2", ps=100.0),
    ]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    assert shard_nodes(a) == [a, b, c]
    assert shard_nodes(c, resource="ps") == [b, a]
