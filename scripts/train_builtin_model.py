"""Train `pycoder`, the small built-in model shipped in `pagectl/assets/pycoder/`.

The corpus is the `.py` source of the running interpreter's standard library (PSF
License). The script trains a byte-level BPE tokenizer and a small Qwen3-architecture
causal LM on it, on CPU, and writes a Hugging Face model directory plus `TRAINING.json`.

Everything that affects the result is seeded: the held-out file split, the data order
and the initialisation. The learning-rate schedule follows the step count; `--max-minutes`
is only a safety cap (if it is reached, the schedule is compressed into the remaining
time and the run is no longer bit-for-bit reproducible, which TRAINING.json records).

Usage:
    python scripts/train_builtin_model.py                      # the shipped model
    python scripts/train_builtin_model.py --quick --out /tmp/pycoder-smoke
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "pagectl" / "assets" / "pycoder"

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [EOS_TOKEN, "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Split before byte-level BPE. Line breaks (with any trailing whitespace before them) are
# pre-tokens of their own and a line's indentation is another, so a prompt that ends in
# "\n" ends on a token boundary seen in training and indentation runs become single
# tokens. Identifiers keep one leading space (" self") and never split at "_".
PRETOKENIZE_PATTERN = (
    r"\s*[\r\n]+"
    r"| ?[\p{L}_][\p{L}\p{N}_]*"
    r"| ?\p{N}+"
    r"| ?[^\s\p{L}\p{N}_]+"
    r"|[ \t]+"
    r"|\s+"
)

# Directories that are test suites (they also hold deliberately malformed files) or not
# the standard library proper; files that are generated tables rather than code.
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "pydoc_data"}
SKIP_DIR_PREFIXES = ("config-",)
SKIP_FILE_PREFIXES = ("_sysconfigdata",)
GENERATED_MARKERS = ("gencodec.py",)
MAX_FILE_BYTES = 400_000
TIMING_START_STEP = 3  # step times are measured from here on; earlier steps compile

CHECK_SNIPPET = (
    "class Stack:\n    def push(self, item):\n\tself._items.append(item)  \n\n"
    "        return  {'a': 0x1F, \"b\": [1_000, 2.5e-3]}\r\n# café → ✓\n"
)
SAMPLE_PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--steps", type=int, default=1368)
    p.add_argument("--max-minutes", type=float, default=45.0, help="cap on the whole run")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--quick", action="store_true", help="tiny model, few steps: a smoke test")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=640)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--max-position-embeddings", type=int, default=2048)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--val-fraction", type=float, default=0.03, help="share of files held out")
    p.add_argument("--eval-windows", type=int, default=160, help="windows per final evaluation")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--autocast", choices=["bf16", "none"], default="bf16")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args(argv)
    if args.quick:
        args.vocab_size, args.hidden_size, args.intermediate_size = 512, 64, 128
        args.layers, args.heads, args.kv_heads, args.head_dim = 2, 4, 2, 16
        args.seq_len, args.batch_size, args.steps, args.warmup_steps = 64, 4, 10, 2
        args.eval_windows, args.log_every, args.eval_every, args.compile = 8, 2, 5, False
    return args


def collect_corpus(stdlib: Path, limit_files: int | None = None) -> list[tuple[str, str]]:
    """Return (relative path, text) for every stdlib module kept, in sorted path order."""
    kept: list[tuple[str, str]] = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if any(d in SKIP_DIRS or d.startswith(SKIP_DIR_PREFIXES) for d in rel.parts[:-1]):
            continue
        if rel.name.startswith(SKIP_FILE_PREFIXES) or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if not text.strip() or any(m in text[:2000] for m in GENERATED_MARKERS):
            continue
        kept.append((rel.as_posix(), text))
        if limit_files is not None and len(kept) >= limit_files:
            break
    return kept


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, out: Path, max_len: int) -> None:
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,
    )
    hf.save_pretrained(out)
    # Both loader generations: v5 reads chat_template.jinja, v4 reads tokenizer_config.json.
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    # v5 writes a list under `extra_special_tokens`, which v4 expects to be a dict; the
    # legacy key is read by both.
    cfg.pop("extra_special_tokens", None)
    cfg["additional_special_tokens"] = SPECIAL_TOKENS[1:]
    cfg.update(add_bos_token=False, add_eos_token=False, clean_up_tokenization_spaces=False)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def check_tokenizer(out: Path, samples: list[str]) -> PreTrainedTokenizerFast:
    """Load the saved tokenizer the way users do and check round trips and the template."""
    hf = AutoTokenizer.from_pretrained(out)
    for text in [CHECK_SNIPPET, *samples]:
        ids = hf(text, add_special_tokens=True, verbose=False)["input_ids"]
        back = hf.decode(ids, skip_special_tokens=False)
        if back != text:
            raise SystemExit(f"tokenizer round trip failed on {text[:60]!r}")
    messages = [{"role": "user", "content": "Write a stack."}]
    rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = "<|im_start|>user\nWrite a stack.<|im_end|>\n<|im_start|>assistant\n"
    if rendered != expected:
        raise SystemExit(f"chat template rendered {rendered!r}")
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    if hf.decode(ids) != expected or ids[0] != hf.convert_tokens_to_ids("<|im_start|>"):
        raise SystemExit("chat template tokenisation mismatch")
    return hf


def encode_stream(hf: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """All texts as one token stream, each file followed by <|endoftext|>."""
    eos = hf.convert_tokens_to_ids(EOS_TOKEN)
    ids: list[int] = []
    for enc in hf.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: torch.Tensor, seq_len: int, offset: int = 0) -> torch.Tensor:
    """Non-overlapping (seq_len + 1)-token windows starting at `offset`: input plus target."""
    n = (stream.numel() - offset - 1) // seq_len
    idx = offset + torch.arange(n)[:, None] * seq_len + torch.arange(seq_len + 1)[None, :]
    return stream[idx]


def batches(stream: torch.Tensor, args: argparse.Namespace):
    """Yield (epoch, batch) forever; order depends only on the seed and the epoch number."""
    epoch = 0
    while True:
        g = torch.Generator().manual_seed(args.seed * 1000 + epoch)
        offset = int(torch.randint(args.seq_len, (1,), generator=g)) if epoch else 0
        w = windows(stream, args.seq_len, offset)
        order = torch.randperm(w.shape[0], generator=g)
        for i in range(0, len(order) - args.batch_size + 1, args.batch_size):
            yield epoch, w[order[i : i + args.batch_size]]
        epoch += 1


def lm_loss(model: torch.nn.Module, batch: torch.Tensor, autocast: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


@torch.no_grad()
def evaluate(model: torch.nn.Module, w: torch.Tensor, args: argparse.Namespace) -> float:
    model.eval()
    w = w[: args.eval_windows]
    losses = [
        lm_loss(model, w[i : i + args.batch_size], args.autocast == "bf16").item()
        * w[i : i + args.batch_size].shape[0]
        for i in range(0, w.shape[0], args.batch_size)
    ]
    model.train()
    return sum(losses) / w.shape[0]


def lr_at(progress: float, step: int, args: argparse.Namespace) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


def build_model(args: argparse.Namespace, vocab_size: int, eos_id: int) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_position_embeddings,
        rope_theta=args.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config)


def save_model(model: Qwen3ForCausalLM, out: Path, eos_id: int, args: argparse.Namespace) -> None:
    model.save_pretrained(out, safe_serialization=True)
    # v4 loaders read `rope_theta` and `torch_dtype`; v5 reads `rope_parameters` and `dtype`.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(rope_theta=args.rope_theta, dtype="float32", torch_dtype="float32")
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    GenerationConfig(
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        do_sample=True,
        temperature=0.7,
        top_p=0.95,
        top_k=50,
        max_new_tokens=256,
    ).save_pretrained(out)


def sample_generations(out: Path) -> list[dict[str, str]]:
    """Reload from disk as users do and greedy-decode the sample prompts."""
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    samples = []
    for prompt in SAMPLE_PROMPTS:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        gen = model.generate(ids, max_new_tokens=80, do_sample=False)
        text = tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=False)
        samples.append({"prompt": prompt, "completion": text})
        print(f"--- greedy: {prompt!r}\n{prompt}{text}\n", flush=True)
    return samples


@dataclass
class Corpus:
    """The tokenised corpus. Streams are files joined by <|endoftext|>, in sorted path order."""

    train_files: list[tuple[str, str]]  # (path relative to the stdlib, text)
    val_files: list[tuple[str, str]]  # held out from both the tokenizer and the model
    tokenizer: PreTrainedTokenizerFast  # reloaded from the saved output directory
    train_stream: torch.Tensor
    val_stream: torch.Tensor

    def stats(self, files: list[tuple[str, str]], stream: torch.Tensor) -> dict[str, int]:
        return {
            "files": len(files),
            "bytes": sum(len(t.encode()) for _, t in files),
            "tokens": stream.numel(),
        }


def prepare_corpus(args: argparse.Namespace) -> Corpus:
    """Collect and split the corpus, train and save the tokenizer, tokenise both splits."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = collect_corpus(stdlib, limit_files=60 if args.quick else None)
    shuffled = list(files)
    random.Random(args.seed).shuffle(shuffled)
    val_names = {name for name, _ in shuffled[: max(1, round(len(files) * args.val_fraction))]}
    train_files = [(n, t) for n, t in files if n not in val_names]
    val_files = [(n, t) for n, t in files if n in val_names]
    print(f"corpus: {len(train_files)} train / {len(val_files)} val files from {stdlib}")

    tok = train_tokenizer([t for _, t in train_files], args.vocab_size)
    save_tokenizer(tok, args.out, args.max_position_embeddings)
    hf = check_tokenizer(args.out, [t for _, t in val_files[:20]])
    corpus = Corpus(
        train_files,
        val_files,
        hf,
        encode_stream(hf, [t for _, t in train_files]),
        encode_stream(hf, [t for _, t in val_files]),
    )
    train = corpus.stats(train_files, corpus.train_stream)
    print(
        f"tokenizer: {len(hf)} tokens; train {train['bytes']} B -> {train['tokens']} tokens "
        f"({train['bytes'] / train['tokens']:.2f} B/token); "
        f"val {corpus.val_stream.numel()} tokens",
        flush=True,
    )
    return corpus


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (embeddings included), none on norm gains."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def train(
    model: Qwen3ForCausalLM, corpus: Corpus, args: argparse.Namespace, deadline: float
) -> dict:
    """Run the training loop; return the figures that go under "result" in TRAINING.json."""
    opt = make_optimizer(model, args)
    forward = torch.compile(model) if args.compile else model
    autocast = args.autocast == "bf16"
    val_windows = windows(corpus.val_stream, args.seq_len)
    t_train = time.monotonic()
    # Leave time for the final evaluation, saving and the reload check.
    train_budget = max(1.0, deadline - t_train - 120)
    curve, recent, step, epoch = [], [], 0, 0
    final_train_loss = float("nan")
    steps_planned, t_timing, shortened = args.steps, 0.0, []
    stream = batches(corpus.train_stream, args)
    model.train()
    while step < args.steps:
        elapsed = time.monotonic() - t_train
        if elapsed >= train_budget:
            print(f"stopping at step {step}: time cap reached", flush=True)
            break
        if step == TIMING_START_STEP:
            t_timing = elapsed
        elif step > TIMING_START_STEP and step % args.log_every == 0:
            # Shorten (never lengthen) the run when it would overrun the time cap, so the
            # cosine still reaches its floor. With a --steps that fits, this never fires and
            # the schedule is a pure function of --steps; shortenings go to TRAINING.json.
            per_step = (elapsed - t_timing) / (step - TIMING_START_STEP)
            fit = step + int(0.98 * (train_budget - elapsed) / per_step)
            if fit < args.steps:
                print(f"{per_step:.2f} s/step: shortening run to {fit} steps", flush=True)
                args.steps = fit
                shortened.append({"at_step": step, "steps": fit})
        lr = lr_at(step / args.steps, step, args)
        for group in opt.param_groups:
            group["lr"] = lr
        epoch, batch = next(stream)
        loss = lm_loss(forward, batch, autocast)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        recent.append(loss.item())
        step += 1
        if step % args.log_every == 0 or step == args.steps:
            mean = sum(recent) / len(recent)
            elapsed = time.monotonic() - t_train
            tok_s = step * args.batch_size * args.seq_len / elapsed
            curve.append({"step": step, "loss": round(mean, 4)})
            print(
                f"step {step:5d}/{args.steps} epoch {epoch} loss {mean:.4f} lr {lr:.2e} "
                f"{tok_s:,.0f} tok/s {elapsed / 60:.1f} min",
                flush=True,
            )
            final_train_loss, recent = mean, []
        if step % args.eval_every == 0 and step < args.steps:
            val = evaluate(model, val_windows[: args.batch_size * 2], args)
            print(f"step {step:5d} val loss (subset) {val:.4f}", flush=True)
            curve[-1]["val_loss_subset"] = round(val, 4)
    train_seconds = time.monotonic() - t_train

    train_windows = windows(corpus.train_stream, args.seq_len)
    order = torch.randperm(train_windows.shape[0], generator=torch.Generator().manual_seed(0))
    val_loss = evaluate(model, val_windows, args)
    train_eval_loss = evaluate(model, train_windows[order], args)
    print(f"final: train loss {final_train_loss:.4f}, val loss {val_loss:.4f}", flush=True)
    tokens_seen = step * args.batch_size * args.seq_len
    return {
        "steps_run": step,
        "stopped_by_time_cap": step < args.steps,
        "tokens_seen": tokens_seen,
        "epochs": round(tokens_seen / corpus.train_stream.numel(), 2),
        "steps_planned": steps_planned,
        "steps_shortened_for_time_cap": shortened,
        "train_seconds": round(train_seconds, 1),
        "final_train_loss": round(final_train_loss, 4),  # mean over the last log interval
        "train_eval_loss": round(train_eval_loss, 4),  # same windows count as val_loss
        "val_loss": round(val_loss, 4),
        "val_windows": min(args.eval_windows, val_windows.shape[0]),
        "loss_curve": curve,
    }


def write_report(
    args: argparse.Namespace, argv: list[str], corpus: Corpus, n_params: int, result: dict
) -> dict:
    report = {
        "command": " ".join(["python scripts/train_builtin_model.py", *argv]),
        "seed": args.seed,
        "python_version": platform.python_version(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "corpus": {
            "description": "The .py source of the CPython standard library (Lib/) of the "
            "interpreter that ran this script, without site-packages, test suites "
            f"({', '.join(sorted(SKIP_DIRS - {'site-packages', '__pycache__'}))}), "
            "generated charmap codec tables, _sysconfigdata and files over "
            f"{MAX_FILE_BYTES} bytes; files joined with {EOS_TOKEN}.",
            "license": "PSF License Agreement (Python Software Foundation License)",
            "train": corpus.stats(corpus.train_files, corpus.train_stream),
            "validation": corpus.stats(corpus.val_files, corpus.val_stream)
            | {"file_names": sorted(name for name, _ in corpus.val_files)},
        },
        "tokenizer": {
            "type": "byte-level BPE (tokenizers)",
            "vocab_size": len(corpus.tokenizer),
            "special_tokens": SPECIAL_TOKENS,
            "pre_tokenize_pattern": PRETOKENIZE_PATTERN,
        },
        "model": {
            "architecture": "Qwen3ForCausalLM",
            "parameters": n_params,
            "dtype": "float32",
            "tie_word_embeddings": True,
        },
        "hyperparameters": {
            k: v for k, v in vars(args).items() if k not in ("out", "quick", "max_minutes")
        }
        | {"optimizer": "AdamW(betas=(0.9, 0.95))", "schedule": "linear warmup, cosine decay"},
        "result": result,
    }
    return report


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    t_start = time.monotonic()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)

    corpus = prepare_corpus(args)
    eos_id = corpus.tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    model = build_model(args, len(corpus.tokenizer), eos_id)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)
    result = train(model, corpus, args, deadline=t_start + args.max_minutes * 60)
    model.generation_config = GenerationConfig()
    save_model(model, args.out, eos_id, args)

    report = write_report(args, argv, corpus, n_params, result)
    report["greedy_samples"] = sample_generations(args.out)
    report["result"]["wall_seconds"] = round(time.monotonic() - t_start, 1)
    (args.out / "TRAINING.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out} in {report['result']['wall_seconds'] / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
