"""Write a tiny Llama-shaped model with random weights and a locally trained tokenizer.

    <vllm venv>/bin/python scripts/make-tiny-model.py --out DIR [--seed 0]

Runs in the real-vLLM venv (torch, transformers and tokenizers come with vLLM).  Nothing is
downloaded: the weights are drawn from a seeded generator and the byte-level BPE tokenizer is
trained on text made here, so the same seed writes the same files.  The result is what `vllm serve
DIR` loads (config.json, model.safetensors, tokenizer.json, tokenizer_config.json with a chat
template); its outputs are noise, which is all a scheduling or serving test needs.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Llama-shaped, as small as vLLM's CPU kernels take: head_dim 64, grouped-query attention.
VOCAB_SIZE = 4096
HIDDEN_SIZE = 256
INTERMEDIATE_SIZE = 512
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
MAX_POSITION_EMBEDDINGS = 4096
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>", "<|pad|>"]
# Llama 3's chat layout, written with this tokenizer's own special tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
WORDS = (
    "the a of to and in is it that for on with as was be by at this from or an are not have but had his "
    "they which one you were her all she there would their we him been has when who will more no if out so "
    "said what up its about into than them can only other new some could time these two may then do first "
    "any my now such like our over man me even most made after also did many before must through back years "
    "where much your way well down should because each just those people how too little state good very make "
    "world still own see men work long get here between both life being under never day same another know "
    "while last might us great old year off come since against go came right used take three request token "
    "model engine cache block prefill decode batch schedule latency throughput kubernetes service replica"
).split()


def corpus(seed: int, lines: int = 4000) -> list[str]:
    """Seeded English-like text: enough for the BPE merges to cover common words and digits."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 24))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 100000)))
        sentence = " ".join(words)
        out.append(sentence[0].upper() + sentence[1:] + rng.choice([".", "?", "!", ","]))
    return out


def make_tokenizer(out: Path, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|pad|>",
        model_max_length=MAX_POSITION_EMBEDDINGS, clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def make_model(out: Path, seed: int, bos_id: int, eos_id: int, pad_id: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS,
        head_dim=HIDDEN_SIZE // NUM_HEADS, max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id, tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="directory to write (replaced if it exists)")
    ap.add_argument("--seed", type=int, default=0, help="seed for the weights and the tokenizer corpus")
    args = ap.parse_args(argv)
    out: Path = args.out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    make_tokenizer(tmp, args.seed)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp)
    make_model(tmp, args.seed, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    (tmp / ".kvpilot-complete").write_text(f"seed {args.seed}\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"tiny model (seed {args.seed}) written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
