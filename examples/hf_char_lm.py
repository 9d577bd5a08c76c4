"""A Hugging Face `GPT2LMHeadModel` on the text of `examples/char_lm.py`, by `scaleout.fit`.

    pip install 'scaleout[hf]'
    python examples/hf_char_lm.py --strategy sync
    scaleout train examples/char_lm.toml --set model.factory='"examples.hf_char_lm:build_model"'

The model is Hugging Face's own, untouched: its `lm_head.weight` *is*
`transformer.wte.weight` (tied), and it returns a `CausalLMOutputWithCrossAttentions`,
whose `logits` the default cross-entropy, the accuracy and the perplexity read. Built from
a config: no weights are downloaded.
"""

from __future__ import annotations

import argparse

from torch import nn

import scaleout
from examples.char_lm import CONFIG, VOCAB, build_data


def build_model(block: int = 64, width: int = 128, layers: int = 2, heads: int = 4) -> nn.Module:
    """GPT-2 with a character vocabulary: input ids (N, T) -> an output with logits
    (N, T, V)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=block,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        bos_token_id=0,  # ASCII NUL: the default (50256) lies outside the vocabulary
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["single", "sync", "downpour"], default="single")
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    overrides = [
        f"train.strategy='{args.strategy}'",
        f"run.name='hf_char_lm_{args.strategy}'",
        f"train.steps={args.steps}",
    ]
    result = scaleout.fit(
        CONFIG, model=build_model, data=build_data, overrides=overrides, overwrite=True
    )
    print(result.summary)


if __name__ == "__main__":
    main()
