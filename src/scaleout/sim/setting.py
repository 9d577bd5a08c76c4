"""What a simulation is of: the machines, their link, and the calibration that prices work.

`--machines 1` is the run exactly as `scaleout train` runs it here: every process on this
one machine, sharing its cores. How each strategy spreads over N > 1 machines is in its
module's docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scaleout.compress.transfer import LINKS, LinkSpeed
from scaleout.errors import ConfigError
from scaleout.sim.calibration import Calibration, ModelCost
from scaleout.sim.engine import Cluster, Link


def parse_link(text: str) -> tuple[float, float]:
    """A link by name (`1gbit`, `ib56`, ...) or rate (`250mbit`): (bytes/s, latency s)."""
    link = LinkSpeed.parse(text)
    return link.bytes_per_s, link.latency_s


@dataclass
class Setting:
    """One simulated configuration: `machines` of `cores` each, joined by `link`."""

    calibration: Calibration
    machines: int = 1
    cores: float | None = None  # per machine; None: the calibrated machine's
    link: Link = field(default_factory=lambda: Link(*LINKS["1gbit"]))
    steps: int | None = None  # steps to simulate; None: the strategy's default
    one_box: bool = False  # the machines are testnet hosts of one box, sharing its cores

    def __post_init__(self) -> None:
        if self.machines < 1:
            raise ConfigError(f"--machines {self.machines}: give whole numbers >= 1")
        if self.cores is not None and self.cores <= 0:
            raise ConfigError(f"--cores-per-machine {self.cores}: give a number > 0")

        idle = self.calibration.idle_cores * (self.machines if self.one_box else 1)
        if self.cores_per_machine <= idle:
            raise ConfigError(
                f"--cores-per-machine {self.cores_per_machine}: Ray alone keeps {idle:.2f} "
                "cores busy; give more"
            )

    @property
    def cores_per_machine(self) -> float:
        return self.cores if self.cores is not None else float(self.calibration.cores)

    def cluster(self) -> Cluster:
        """The simulated machines, less the cores Ray's idle processes keep busy."""
        cal = self.calibration
        return Cluster(
            self.machines, self.cores_per_machine, self.link, cal.idle_cores, self.one_box
        )


def compute_shares(flops: list[int], params: list[int]) -> list[float]:
    """Each part's share of a step's compute: of the forward FLOPs, or of the parameters
    where the FLOP counter saw none."""
    weights = flops if sum(flops) > 0 else params
    total = max(sum(weights), 1)
    return [w / total for w in weights]


def model_cost(config: Any, calibration: Calibration) -> ModelCost:  # noqa: ANN401
    """The calibrated compute of `config`'s model (priced by FLOPs when not measured)."""
    from scaleout.sim.measuring import model_key

    key = model_key(config)
    if key in calibration.models:
        return calibration.models[key]
    from scaleout.info import describe_model

    info = describe_model(config)
    return calibration.model_cost(key, info.params, info.forward_flops)
