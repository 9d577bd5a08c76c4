"""A small GPT trained character by character, by `scaleout.fit`, under any strategy.

    python examples/char_lm.py                          # single, sync and downpour in turn
    python examples/char_lm.py --strategy sync --precision bf16
    scaleout train examples/char_lm.toml --set train.strategy='"downpour"'   # the same by TOML

The model is plain PyTorch with the parts language models have today: token and position
embeddings, pre-norm causal self-attention blocks, and an output layer that *is* the token
embedding (tied weights). It returns logits (N, T, V) for targets (N, T), so the default
cross-entropy reads the last dimension as the classes and the run reports token accuracy
and perplexity. The text is the Python standard library's own source, found through
`sysconfig` on every machine that runs Python: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

import scaleout

VOCAB = 128  # ASCII; any other character reads as "?"
UNKNOWN = ord("?")


# --- the model: architecture only -----------------------------------------------------------


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, each added back: (N, T, D) -> (N, T, D)."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )

    def forward(self, x: Tensor) -> Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=2)  # (N, T, D) each
        q, k, v = (z.view(n, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)  # (N, H, T, *)
        x = x + self.proj(y.transpose(1, 2).reshape(n, t, d))
        return x + self.mlp(self.norm2(x))


class Embedding(nn.Module):
    """Tokens (N, T) -> token plus position embeddings (N, T, D)."""

    def __init__(self, vocab: int, block: int, width: int) -> None:
        super().__init__()
        self.block = block
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(block, width)

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        if t > self.block:
            raise ValueError(f"sequences of {t} tokens exceed the model's block of {self.block}")
        positions = torch.arange(t, device=tokens.device)
        return self.tokens(tokens) + self.positions(positions)  # (N, T, D)


class CharGPT(nn.Module):
    """Tokens (N, T) -> next-token logits (N, T, V); `head.weight` is `embed.tokens.weight`."""

    def __init__(
        self,
        vocab: int = VOCAB,
        block: int = 64,
        width: int = 160,
        layers: int = 4,
        heads: int = 5,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width = {width} must be a multiple of heads = {heads}")
        self.embed = Embedding(vocab, block, width)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.tokens.weight  # tied: one parameter, two uses
        # the parts the forward runs in turn: where pipeline stages may cut
        self.pipeline_split = ["embed", *(f"blocks.{i}" for i in range(layers)), "norm", "head"]
        self.apply(_init)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)  # (N, T, D)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # (N, T, V)


def _init(module: nn.Module) -> None:
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build_model(block: int = 64, width: int = 160, layers: int = 4, heads: int = 5) -> nn.Module:
    """The example's GPT: 1.26M parameters at the defaults."""
    return CharGPT(VOCAB, block, width, layers, heads)


# --- the data: ASCII text of the standard library --------------------------------------------


def corpus(max_chars: int) -> torch.Tensor:
    """The first `max_chars` characters of the standard library's top-level modules, in
    file-name order, as ASCII codes (L,) uint8."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    codes = bytearray()
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        codes += bytes(c if c < VOCAB else UNKNOWN for c in text.encode("ascii", "replace"))
        if len(codes) >= max_chars:
            break
    if len(codes) < 2:
        raise ValueError(f"no Python source found under {stdlib}")
    return torch.frombuffer(codes[:max_chars], dtype=torch.uint8).clone()


class CharWindows(Dataset):
    """Non-overlapping windows of `block` + 1 characters: (x, y) = (chars[:-1], chars[1:]),
    each (T,) int64. Batched fetch (`__getitems__`, `collate`) for the loader."""

    def __init__(self, codes: torch.Tensor, block: int) -> None:
        self.block = block
        count = (len(codes) - 1) // block
        self.codes = codes[: count * block + 1].long()

    def __len__(self) -> int:
        return (len(self.codes) - 1) // self.block

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        window = self.codes[i * self.block : (i + 1) * self.block + 1]
        return window[:-1], window[1:]

    def __getitems__(self, indices: list[int]) -> tuple[Tensor, Tensor]:
        starts = torch.as_tensor(indices).unsqueeze(1) * self.block  # (N, 1)
        windows = self.codes[starts + torch.arange(self.block + 1)]  # (N, T + 1)
        return windows[:, :-1], windows[:, 1:]

    @staticmethod
    def collate(batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        return batch


def build_data(
    block: int = 64, max_chars: int = 2_000_000, test_chars: int = 65_536
) -> tuple[Dataset, Dataset]:
    """(train, test): the corpus less its last `test_chars` characters, and those."""
    codes = corpus(max_chars)
    split = len(codes) - test_chars
    return CharWindows(codes[:split], block), CharWindows(codes[split:], block)


# --- training ---------------------------------------------------------------------------------

CONFIG = {
    "run": {"name": "char_lm", "seed": 0, "device": "cpu", "num_threads": 1},
    "train": {
        "steps": 600,
        "batch_size": 32,
        "optimizer": "adamw",
        "lr": 3e-3,
        "weight_decay": 0.1,
        "betas": [0.9, 0.95],
        "lr_schedule": "cosine",
        "warmup_steps": 60,
        "min_lr_ratio": 0.1,
        "grad_clip_norm": 1.0,
        "eval_every": 200,
        "eval_batch_size": 256,
        "log_every": 50,
        "checkpoint_every": 600,
    },
    "downpour": {"num_replicas": 2, "num_shards": 2, "n_fetch": 1, "n_push": 1},
    "sync": {"num_workers": 2},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["single", "sync", "downpour"], action="append")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    results = {}
    for strategy in args.strategy or ["single", "sync", "downpour"]:
        overrides = [
            f"train.strategy='{strategy}'",
            f"run.name='char_lm_{strategy}'",
            f"run.precision='{args.precision}'",
            f"train.accumulate_steps={args.accumulate}",
            f"train.steps={args.steps}",
        ]
        result = scaleout.fit(
            CONFIG, model=build_model, data=build_data, overrides=overrides, overwrite=True
        )
        results[strategy] = result.summary
    print(f"{'strategy':10} {'test loss':>10} {'perplexity':>11} {'token acc':>10}")
    for strategy, summary in results.items():
        print(
            f"{strategy:10} {summary['final_test_loss']:10.4f} "
            f"{summary['final_test_perplexity']:11.3f} {100 * summary['final_test_accuracy']:9.2f}%"
        )


if __name__ == "__main__":
    main()
