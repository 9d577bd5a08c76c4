"""The 8-bit code tables, built from each data type's bit layout (Dettmers 2015, section 4.1).

Every 8-bit codec here maps a normalised magnitude `a = |x| / scale` to one of 256 codes and
back: `decode(code) = values[code] * scale`. A `CodeTable` holds, per code, the float32 value
it decodes to and, per sign, the magnitudes in ascending order with the code that stands for
each; the encoder's rounding is then only a list of thresholds between neighbouring
magnitudes (see `thresholds`). Nothing here is typed in: the tables are generated from the
rules in shared/notes/codecs.md and checked against its anchor values in the tests.

- `dynamic8`: the 2015 dynamic tree as the original kernel stores it: bit 7 = sign, bits 0-6 =
  index into 126 sorted magnitudes (decades 10^0..10^-5, each a bisection tree split at 0.45),
  126 = zero, 127 = 1.0.
- `dynamic8_bnb`: bitsandbytes' `create_dynamic_map(signed=True)`, a 256-entry sorted signed
  map (a uniform tree over (0.1, 1), 7 decades, +1.0 but no -1.0).
- `static8`: sign, 3-bit exponent e, 4-bit tree t: 10^-e * (8 centres of [0.1, 0.45], 8 of
  [0.45, 1]); the exponent offset is a fixed scale 10^K. The smallest code (e = 7, t = 0)
  stands for zero so that zeros survive (the paper's layout has no zero).
- `mantissa8`: sign, 3-bit exponent e, 4-bit integer mantissa m: m * 10^-e (scale 10^K).
- `linear8`: sign and 7-bit k: k / 127 (absmax-normalised).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Literal

import numpy as np
import torch

Rounding = Literal["nearest", "paper"]

SIGN_BIT = 0x80
# The 2015 kernel's constants (kCompression_8bit): below this, zero; above, 1.0.
PAPER_ZERO_BELOW = np.float32(1.5e-6)
PAPER_ONE_ABOVE = np.float32(0.995703)


@dataclass(frozen=True)
class CodeTable:
    """One 8-bit data type: what each code decodes to and how magnitudes map to codes.

    `values[c]` is the normalised float32 value of code c (sign included). For each sign,
    `magnitudes` (ascending, float32, the first may be 0) lists the distinct magnitudes the
    encoder chooses among and `codes` the code it writes for each (for duplicated values,
    as in `mantissa8`, one canonical code).
    """

    name: str
    values: np.ndarray  # (256,) float32
    pos_magnitudes: np.ndarray  # (P,) float32 ascending
    pos_codes: np.ndarray  # (P,) uint8
    neg_magnitudes: np.ndarray  # (Q,) float32 ascending
    neg_codes: np.ndarray  # (Q,) uint8
    paper_rounding: bool  # whether the 2015 kernel's rounding is defined for this table

    def thresholds(self, rounding: Rounding = "nearest") -> tuple[np.ndarray, np.ndarray]:
        """Decision thresholds per sign, float32 ascending: magnitude a gets the code of rank
        `count(thresholds < a)`, so ties go to the smaller magnitude."""
        if rounding == "nearest":
            return nearest_thresholds(self.pos_magnitudes), nearest_thresholds(self.neg_magnitudes)
        if rounding != "paper":
            raise ValueError(f"rounding = {rounding!r}: use 'nearest' or 'paper'")
        if not self.paper_rounding:
            raise ValueError(
                f"rounding = 'paper' reproduces the 2015 kernel and is not defined for "
                f"{self.name}; use rounding = 'nearest'"
            )
        if self.name == "dynamic8":
            thr = dynamic8_paper_thresholds(self.pos_magnitudes)
        else:
            thr = paper_thresholds(self.pos_magnitudes)
        return thr, thr


def nearest_thresholds(magnitudes: np.ndarray) -> np.ndarray:
    """Round-to-nearest: the largest float32 at or below each exact midpoint, so a float32
    magnitude goes up exactly when it is nearer the upper neighbour (ties go down)."""
    mags = magnitudes.astype(np.float64)
    return _float32_at_or_below((mags[1:] + mags[:-1]) / 2)  # exact in float64


def paper_thresholds(magnitudes: np.ndarray) -> np.ndarray:
    """The 2015 kernel's rounding (notes section 3) on the sorted table T of the nonzero
    magnitudes: inside (T[2k], T[2k+1]] with k >= 1 it rounds toward zero (to T[2k]);
    everywhere else to the nearest, including the step between zero and T[0]. Only the
    dynamic tree's kernel is public; for the other types this is the same search applied to
    their tables, which approximates the paper's table rather than reproducing it exactly
    (the `codecs` benchmark compares them)."""
    thr = nearest_thresholds(magnitudes)
    first = 1 if magnitudes[0] == 0 else 0  # rank of T[0]
    for rank in range(first, len(magnitudes) - 1):
        j = rank - first  # index in T
        if j >= 2 and j % 2 == 0:
            thr[rank] = magnitudes[rank + 1]  # a <= T[j+1] -> T[j]
    return thr


def dynamic8_paper_thresholds(magnitudes: np.ndarray) -> np.ndarray:
    """`paper_thresholds` on the 126 tree values, plus the kernel's own ends: a < 1.5e-6 is
    zero (not the midpoint 1.375e-6) and a > 0.995703 is 1.0."""
    assert magnitudes[0] == 0 and magnitudes[-1] == 1 and len(magnitudes) == 128
    thr = paper_thresholds(magnitudes[:-1])  # zero + T[0..125]
    zero = np.nextafter(PAPER_ZERO_BELOW, np.float32(0))  # a >= 1.5e-6 leaves zero
    return np.concatenate([[zero], thr[1:], [PAPER_ONE_ABOVE]]).astype(np.float32)


def _float32_at_or_below(x: np.ndarray) -> np.ndarray:
    y = x.astype(np.float32)
    above = y.astype(np.float64) > x
    y[above] = np.nextafter(y[above], np.float32(0))
    return y


def _tree(num_cells: int) -> np.ndarray:
    """Centres of `num_cells` equal cells of [0.1, 0.45] then of [0.45, 1] (float64): the
    bisection tree of notes section 2, whose first split is at 0.45."""
    k = np.arange(num_cells) + 0.5
    return np.concatenate([0.1 + 0.35 * k / num_cells, 0.45 + 0.55 * k / num_cells])


def dynamic_tree_magnitudes() -> np.ndarray:
    """The 126 sorted magnitudes of the 2015 dynamic tree: decade d = 0..5 (n = d leading
    zero bits, one flag bit, 6 - d tree bits) holds 2^(6-d) tree values times 10^-d."""
    decades = [_tree(2 ** (5 - d)) * 10.0**-d for d in range(6)]
    return np.sort(np.concatenate(decades))


def _sign_magnitude(name: str, magnitude_of_code: np.ndarray, paper: bool) -> CodeTable:
    """A table whose bit 7 is the sign and whose low 7 bits index `magnitude_of_code`."""
    mags7 = magnitude_of_code.astype(np.float32)  # (128,)
    values = np.concatenate([mags7, -mags7]).astype(np.float32)
    distinct, first_code = np.unique(mags7, return_index=True)  # ascending, canonical code
    codes = first_code.astype(np.uint8)
    return CodeTable(name, values, distinct, codes, distinct, codes | SIGN_BIT, paper)


@cache
def dynamic8_table() -> CodeTable:
    mags = np.concatenate([dynamic_tree_magnitudes(), [0.0, 1.0]])  # codes 0..125, 126, 127
    return _sign_magnitude("dynamic8", mags, paper=True)


@cache
def linear8_table() -> CodeTable:
    return _sign_magnitude("linear8", np.arange(128) / 127, paper=True)


@cache
def static8_table() -> CodeTable:
    tree = _tree(8)  # (16,)
    mags = np.concatenate([10.0**-e * tree for e in range(8)])  # code = e << 4 | t
    mags[7 << 4] = 0.0  # the smallest value (about 1.2e-8 * 10^K) becomes zero
    return _sign_magnitude("static8", mags, paper=True)


@cache
def mantissa8_table() -> CodeTable:
    m = np.arange(16)
    mags = np.concatenate([m * 10.0**-e for e in range(8)])  # code = e << 4 | m
    return _sign_magnitude("mantissa8", mags, paper=True)


def bnb_dynamic_map() -> np.ndarray:
    """bitsandbytes `create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8)`,
    computed the way it computes it (float32 linspace and products): 127 negative
    values, 0 at index 127, 128 positive values ending in 1.0 at index 255."""
    data: list[float] = []
    for i in range(7):
        bounds = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += (10 ** (-6 + i) * means).tolist() + (-(10 ** (-6 + i)) * means).tolist()
    data += [0.0, 1.0]
    return np.sort(np.array(data, dtype=np.float32))


@cache
def dynamic8_bnb_table() -> CodeTable:
    values = bnb_dynamic_map()  # (256,) sorted; code = index
    zero = int(np.flatnonzero(values == 0)[0])
    pos_codes = np.arange(zero, 256, dtype=np.uint8)  # 0, then ascending positives
    neg_codes = np.arange(zero, -1, -1).astype(np.uint8)  # 0, then descending negatives
    return CodeTable(
        "dynamic8_bnb",
        values,
        values[pos_codes],
        pos_codes,
        -values[neg_codes],
        neg_codes,
        paper_rounding=False,
    )


TABLES = {
    "dynamic8": dynamic8_table,
    "dynamic8_bnb": dynamic8_bnb_table,
    "static8": static8_table,
    "mantissa8": mantissa8_table,
    "linear8": linear8_table,
}


def get_table(name: str) -> CodeTable:
    if name not in TABLES:
        raise ValueError(f"no 8-bit table {name!r}; known: {', '.join(TABLES)}")
    return TABLES[name]()
