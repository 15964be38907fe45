"""Train the demo model: a tiny Llama that has memorised this project's own documentation.

    .venv/bin/python scripts/train_demo_model.py [--rev REV] [--out DIR] [--steps N]

The corpus is README.md and docs/*.md as committed at ``REV`` (default ``HEAD``, read with
``git show``, so the working tree's edits do not leak in and a recorded revision reproduces the
corpus exactly). Fenced code blocks and tables are dropped and hard-wrapped paragraphs joined
into one line each: the model learns the prose. A byte-level BPE tokenizer (``tokenizers``) is
trained on that text, then a Llama decoder (grouped-query attention, RoPE, SwiGLU, tied
embeddings) in plain torch, on random windows of the token stream, from a fixed seed with two
threads and deterministic algorithms: the same revision, flags, torch and tokenizers versions
give the same bytes on the same CPU.

Written to ``--out`` (default ``kvtransfer/models/demo-llama``) in Hugging Face's layout, which
``kvtransfer.engine.model.loader`` (and transformers) read: ``config.json``,
``generation_config.json``, ``model.safetensors`` (HF tensor names), ``tokenizer.json``,
``tokenizer_config.json`` and ``training.json`` (revision, corpus files with their SHA-256, every
hyperparameter, the loss curve, the wall time).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "kvtransfer" / "models" / "demo-llama"
SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>")
# The built-in models' chat format (kvtransfer.engine.model.chat_template), so that
# /v1/chat/completions works; the model never saw a chat, it answers with documentation.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Hyper:
    """Everything that decides the result besides the corpus (recorded in training.json)."""

    seed: int = 0
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 512
    seq_len: int = 128
    batch_size: int = 32
    steps: int = 1500
    lr: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    threads: int = 2


# ---- corpus -------------------------------------------------------------------------------


def corpus_files(rev: str) -> list[str]:
    listed = _git("ls-tree", "--name-only", rev, "README.md", "docs/").splitlines()
    files = [name for name in listed if name == "README.md" or name.endswith(".md")]
    if "README.md" not in files:
        raise ValueError(f"revision {rev!r} has no README.md")
    return sorted(files)


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True
    ).stdout


_TABLE = re.compile(r"^\s*\|")
_BLOCK = re.compile(r"^\s*(#|[-*+] |\d+\. )")


def prose(markdown: str) -> str:
    """The prose of a Markdown page: no code blocks or tables, one line per paragraph, list
    item and heading."""
    out: list[str] = []
    paragraph: list[str] = []
    fenced = False

    def flush() -> None:
        if paragraph:
            out.append(" ".join(paragraph))
            paragraph.clear()

    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            flush()
            continue
        if fenced or _TABLE.match(line):
            flush()
            continue
        if not line.strip():
            flush()
            if out and out[-1] != "":
                out.append("")
            continue
        if _BLOCK.match(line):
            flush()
        paragraph.append(line.strip())
    flush()
    return "\n".join(out).strip() + "\n"


# ---- tokenizer ----------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


# ---- model (Hugging Face's LlamaForCausalLM math, its tensor names) ------------------------


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, h: Hyper) -> None:
        super().__init__()
        self.heads, self.kv_heads = h.num_attention_heads, h.num_key_value_heads
        self.head_dim = h.hidden_size // h.num_attention_heads
        self.q_proj = nn.Linear(h.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, h: Hyper) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(h.hidden_size, h.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h.hidden_size, h.intermediate_size, bias=False)
        self.down_proj = nn.Linear(h.intermediate_size, h.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, h: Hyper) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(h.hidden_size, h.rms_norm_eps)
        self.self_attn = Attention(h)
        self.post_attention_layernorm = RMSNorm(h.hidden_size, h.rms_norm_eps)
        self.mlp = MLP(h)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """``model.*`` of HF's LlamaForCausalLM; the tied ``lm_head`` is ``embed_tokens``."""

    def __init__(self, h: Hyper) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(h.vocab_size, h.hidden_size)
        self.layers = nn.ModuleList(Layer(h) for _ in range(h.num_hidden_layers))
        self.norm = RMSNorm(h.hidden_size, h.rms_norm_eps)
        head_dim = h.hidden_size // h.num_attention_heads
        inv_freq = 1.0 / h.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        freqs = (
            torch.arange(ids.shape[1], device=ids.device).float()[:, None] * self.inv_freq[None, :]
        )
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return F.linear(self.norm(x), self.embed_tokens.weight)


class LlamaForCausalLM(nn.Module):
    def __init__(self, h: Hyper) -> None:
        super().__init__()
        self.model = Decoder(h)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)


def init_weights(model: nn.Module, h: Hyper) -> None:
    """Normal(0, 0.02) like HF, residual outputs scaled down with depth (GPT-2's rule)."""
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            continue
        std = 0.02
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            std /= math.sqrt(2 * h.num_hidden_layers)
        nn.init.normal_(param, mean=0.0, std=std)


# ---- training -----------------------------------------------------------------------------


def lr_at(step: int, h: Hyper) -> float:
    if step < h.warmup_steps:
        return h.lr * (step + 1) / h.warmup_steps
    progress = (step - h.warmup_steps) / max(1, h.steps - h.warmup_steps)
    return h.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(tokens: torch.Tensor, h: Hyper, log_every: int = 50) -> tuple[nn.Module, list[dict]]:
    torch.manual_seed(h.seed)
    model = LlamaForCausalLM(h)
    init_weights(model, h)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": h.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=h.lr,
        betas=(0.9, 0.95),
        foreach=False,
    )
    windows = torch.Generator().manual_seed(h.seed)
    last_start = len(tokens) - h.seq_len - 1
    if last_start < 1:
        raise ValueError(f"corpus of {len(tokens)} tokens is shorter than seq_len {h.seq_len}")
    offsets = torch.arange(h.seq_len + 1)
    curve: list[dict] = []
    running = None
    started = time.monotonic()
    for step in range(h.steps):
        starts = torch.randint(0, last_start + 1, (h.batch_size,), generator=windows)
        batch = tokens[starts[:, None] + offsets[None, :]]
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, h)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        value = loss.item()
        running = value if running is None else 0.9 * running + 0.1 * value
        if step % log_every == 0 or step == h.steps - 1:
            elapsed = time.monotonic() - started
            curve.append({"step": step, "loss": round(value, 4), "elapsed_s": round(elapsed, 1)})
            print(f"step {step:5d}  loss {value:.3f}  (avg {running:.3f})  {elapsed:6.1f}s")
            sys.stdout.flush()
    return model, curve


@torch.no_grad()
def corpus_loss(model: nn.Module, tokens: torch.Tensor, seq_len: int) -> float:
    """Mean next-token loss over the whole stream, in consecutive windows."""
    total, count = 0.0, 0
    for start in range(0, len(tokens) - 1, seq_len):
        window = tokens[start : start + seq_len + 1][None]
        logits = model(window[:, :-1])
        total += F.cross_entropy(logits[0], window[0, 1:], reduction="sum").item()
        count += window.shape[1] - 1
    return total / count


@torch.no_grad()
def greedy(model: nn.Module, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(model(torch.tensor([out]))[0, -1].argmax()))
    return out[len(ids) :]


# ---- output -------------------------------------------------------------------------------


def hf_config(h: Hyper, bos: int, eos: int, pad: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": h.vocab_size,
        "hidden_size": h.hidden_size,
        "intermediate_size": h.intermediate_size,
        "num_hidden_layers": h.num_hidden_layers,
        "num_attention_heads": h.num_attention_heads,
        "num_key_value_heads": h.num_key_value_heads,
        "head_dim": h.hidden_size // h.num_attention_heads,
        "hidden_act": "silu",
        "rope_theta": h.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": h.rms_norm_eps,
        "max_position_embeddings": h.max_position_embeddings,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "float32",
    }


CORPUS_FILE = "corpus.json"


def corpus_json(texts: dict[str, str]) -> str:
    """The prose trained on, per file, as shipped next to the model: tests and readers need no
    git history (a shallow clone lacks the recorded revision)."""
    return json.dumps(texts, indent=0, sort_keys=True, ensure_ascii=False) + "\n"


def load_corpus(directory: Path) -> dict[str, str]:
    """The shipped corpus, checked against the SHA-256 that ``training.json`` records."""
    raw = (directory / CORPUS_FILE).read_text(encoding="utf-8")
    recorded = json.loads((directory / "training.json").read_text())["corpus_sha256"]
    actual = hashlib.sha256(raw.encode()).hexdigest()
    if actual != recorded:
        raise ValueError(f"{directory / CORPUS_FILE} has SHA-256 {actual}, not {recorded}")
    return json.loads(raw)


def write_model(out: Path, model: nn.Module, tokenizer, h: Hyper, meta: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    bos, eos, pad = (tokenizer.token_to_id(t) for t in SPECIAL_TOKENS)
    config = hf_config(h, bos, eos, pad)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "pad_token": SPECIAL_TOKENS[2],
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    # Tied: HF checkpoints then store only the embedding.
    tensors = {name: p.detach().contiguous() for name, p in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default="HEAD", help="git revision whose docs are the corpus")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    defaults = Hyper()
    for name, value in asdict(defaults).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    args = parser.parse_args(argv)
    h = Hyper(**{name: getattr(args, name) for name in asdict(defaults)})

    torch.set_num_threads(h.threads)
    torch.use_deterministic_algorithms(True)
    commit = _git("rev-parse", args.rev).strip()
    files = corpus_files(commit)
    raw = {name: _git("show", f"{commit}:{name}") for name in files}
    texts = [prose(raw[name]) for name in files]
    corpus = corpus_json(dict(zip(files, texts, strict=True)))
    tokenizer = train_tokenizer(texts, h.vocab_size)
    if tokenizer.get_vocab_size() != h.vocab_size:
        raise ValueError(
            f"the corpus yields only {tokenizer.get_vocab_size()} tokens, not {h.vocab_size}"
        )
    eos = tokenizer.token_to_id(SPECIAL_TOKENS[1])
    stream: list[int] = []
    for text in texts:  # each page ends with <eos>
        stream += [*tokenizer.encode(text).ids, eos]
    tokens = torch.tensor(stream, dtype=torch.long)
    print(
        f"corpus: {len(files)} files at {commit[:12]}, {sum(map(len, texts))} chars, "
        f"{len(tokens)} tokens"
    )
    started = time.monotonic()
    model, curve = train(tokens, h)
    wall = time.monotonic() - started
    model.eval()
    final = corpus_loss(model, tokens, h.seq_len)
    meta = {
        "what": "kvtransfer's demo model: a tiny Llama trained on the project's own docs",
        "script": "scripts/train_demo_model.py",
        "script_sha256": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
        "corpus_revision": commit,
        "corpus_files": {name: hashlib.sha256(raw[name].encode()).hexdigest() for name in files},
        "corpus_sha256": hashlib.sha256(corpus.encode()).hexdigest(),
        "corpus_chars": sum(map(len, texts)),
        "corpus_tokens": len(tokens),
        "hyperparameters": asdict(h),
        "versions": {"torch": torch.__version__, "tokenizers": _tokenizers_version()},
        "train_wall_s": round(wall, 1),
        "final_batch_loss": curve[-1]["loss"],
        "final_corpus_loss": round(final, 4),
        "loss_curve": curve,
    }
    write_model(args.out, model, tokenizer, h, meta)
    (args.out / CORPUS_FILE).write_text(corpus, encoding="utf-8")
    for prompt in ("Prefill computes", "The decode daemon", "kvtransfer splits"):
        ids = tokenizer.encode(prompt).ids
        print(f"{prompt!r} -> {tokenizer.decode(greedy(model, ids, 24))!r}")
    print(f"wrote {args.out} in {wall:.0f}s of training, loss over the corpus {final:.4f}")
    return 0


def _tokenizers_version() -> str:
    import tokenizers

    return tokenizers.__version__


if __name__ == "__main__":
    sys.exit(main())
