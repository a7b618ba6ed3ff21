"""Rotation artifacts: the directory ``oscar-calibrate`` writes and the server loads.

Layout (DESIGN.md invariant 6)::

    DIR/manifest.json          format name and version, model fingerprint, method,
                               defaults (sink, recent, group size), the row format of
                               each layer's keys and values (version 2), calibration summary
    DIR/rotations.safetensors  per layer i, float32:
                                 layers.{i}.k_rotation [kv_heads, d, d]
                                 layers.{i}.v_rotation [kv_heads, d, d]
                                 layers.{i}.k_mean     [kv_heads, d]
                                 layers.{i}.k_clip     [kv_heads]   clip ratio in (0, 1]
                                 layers.{i}.v_clip     [kv_heads]
                                 layers.{i}.k_scale    [kv_heads, d]  per-channel key scale > 0
                                                                      (version 3; absent: all ones)

:func:`load` validates everything (files, version, fingerprint against the
served model, shapes, finiteness, orthogonality) and raises
:class:`ArtifactError` with one sentence naming the file and the mismatch.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from . import rotation as rot
from .format import BITS, RowFormat, check_shape

FORMAT_NAME = "oscar-sglang-rotations"
FORMAT_VERSION = 3  # written only when some layer scales its key channels; otherwise version 2
READABLE_VERSIONS = (1, 2, 3)  # 1: every layer INT2 with the default group; 2: per-layer formats; 3: key scales
KEY_SCALE_BOUNDS = (1.0 / 64, 64.0)
MANIFEST = "manifest.json"
TENSORS = "rotations.safetensors"
ORTHOGONALITY_TOL = 1e-4
# A rotations directory is untrusted input: sizes are bounded before anything is read or allocated.
MAX_MANIFEST_BYTES = 1 << 20
MAX_HEADER_BYTES = 16 << 20
FINGERPRINT_BOUNDS = {"num_layers": 4096, "hidden_size": 1 << 20, "num_attention_heads": 4096,
                      "num_kv_heads": 4096, "head_dim": 4096, "vocab_size": 1 << 24}
TENSOR_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
DEFAULT_SINK = 64
DEFAULT_RECENT = 256


class ArtifactError(ValueError):
    """A rotations directory that cannot be served; the message names the file and the problem."""


@dataclass(frozen=True)
class ModelFingerprint:
    """What a rotation artifact must agree with in the served model."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_type: str
    rope_theta: float

    @classmethod
    def from_config(cls, config) -> "ModelFingerprint":
        """Build from a transformers ``PretrainedConfig`` (or anything with the same attributes)."""
        text = getattr(config, "text_config", None) or config
        heads = int(text.num_attention_heads)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        archs = getattr(config, "architectures", None) or [getattr(config, "model_type", "unknown")]
        rope = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
        theta = rope.get("rope_theta", getattr(text, "rope_theta", None))
        return cls(
            architecture=str(archs[0]),
            num_layers=int(text.num_hidden_layers),
            hidden_size=int(text.hidden_size),
            num_attention_heads=heads,
            num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            vocab_size=int(text.vocab_size),
            rope_type=str(rope.get("rope_type", rope.get("type", "default"))),
            rope_theta=float(theta) if theta is not None else float("nan"),
        )

    def mismatches(self, other: "ModelFingerprint") -> list[str]:
        out = []
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            same = (math.isclose(a, b, rel_tol=1e-9) or (math.isnan(a) and math.isnan(b))) if isinstance(a, float) else a == b
            if not same:
                out.append(f"{f.name} {a!r} in the artifact vs {b!r} in the model")
        return out


@dataclass
class LayerRotation:
    """One layer's rotations, key means, clip ratios and key channel scales (float32, on CPU unless moved).

    Keys are written as ``k' = ((k - mean) R_K) * s`` and queries read as
    ``q' = (q R_K) / s`` (``s = k_scale`` per KV head and channel), so
    ``q' . k'`` is the exact logit before quantization: the scale is a
    per-channel key scaling folded into the key transform, with its inverse
    transpose on the query side (:attr:`k_transform`, :attr:`q_transform`).
    ``k_scale=None`` means all ones (no scaling; artifacts before version 3).
    """

    k_rotation: torch.Tensor
    v_rotation: torch.Tensor
    k_mean: torch.Tensor
    k_clip: torch.Tensor
    v_clip: torch.Tensor
    k_scale: torch.Tensor | None = None

    TENSOR_NAMES = ("k_rotation", "v_rotation", "k_mean", "k_clip", "v_clip", "k_scale")
    UNSCALED_NAMES = TENSOR_NAMES[:5]  # what version 1 and 2 files hold

    def __post_init__(self):
        if self.k_scale is None:
            self.k_scale = torch.ones(self.k_mean.shape, dtype=self.k_mean.dtype, device=self.k_mean.device)

    @staticmethod
    def expected_shapes(kv_heads: int, d: int) -> dict[str, tuple[int, ...]]:
        return {
            "k_rotation": (kv_heads, d, d),
            "v_rotation": (kv_heads, d, d),
            "k_mean": (kv_heads, d),
            "k_clip": (kv_heads,),
            "v_clip": (kv_heads,),
            "k_scale": (kv_heads, d),
        }

    @property
    def scaled(self) -> bool:
        """Whether any key channel is scaled (the artifact then needs format version 3)."""
        return bool((self.k_scale != 1).any())

    @property
    def k_transform(self) -> torch.Tensor:
        """Write-path key matrix ``R_K diag(s)`` per KV head (``(k - mean) @ it`` is the stored row)."""
        return self.k_rotation * self.k_scale.unsqueeze(-2)

    @property
    def q_transform(self) -> torch.Tensor:
        """Read-path query matrix ``R_K diag(1/s)``, the inverse transpose of :attr:`k_transform`."""
        return self.k_rotation / self.k_scale.unsqueeze(-2)

    def to(self, device=None, dtype=torch.float32) -> "LayerRotation":
        return LayerRotation(*(getattr(self, n).to(device=device, dtype=dtype) for n in self.TENSOR_NAMES))


@dataclass(frozen=True)
class LayerFormat:
    """The row formats of one layer's keys and values (a precision policy's choice for the layer)."""

    k: RowFormat
    v: RowFormat

    def to_json(self) -> dict:
        return {"k": self.k.to_json(), "v": self.v.to_json()}

    def bits_per_element(self, head_dim: int) -> float:
        """Average stored bits per K/V element of the layer (scale and zero included)."""
        return (self.k.bits_per_element(head_dim) + self.v.bits_per_element(head_dim)) / 2


@dataclass
class RotationArtifacts:
    model: ModelFingerprint
    method: str
    layers: list[LayerRotation]
    sink: int = DEFAULT_SINK
    recent: int = DEFAULT_RECENT
    group_size: int | None = None  # None: one group per row (G = head_dim)
    calibration: dict = field(default_factory=dict)
    # Per-layer row formats (a precision policy); None: every layer INT2 with ``group_size``.
    formats: list[LayerFormat] | None = None

    @property
    def group(self) -> int:
        return self.group_size or self.model.head_dim

    @property
    def layer_formats(self) -> list[LayerFormat]:
        """Every layer's K and V row formats, groups spelled out."""
        d = self.model.head_dim
        if self.formats is None:
            f = RowFormat(2, self.group)
            return [LayerFormat(f, f)] * len(self.layers)
        return [LayerFormat(lf.k.resolved(d), lf.v.resolved(d)) for lf in self.formats]

    @property
    def bits_per_element(self) -> float:
        """Average stored bits per K/V element over all layers (scale and zero included)."""
        fs = self.layer_formats
        return sum(f.bits_per_element(self.model.head_dim) for f in fs) / max(len(fs), 1)

    def bytes_per_token(self, kv_heads: int | None = None) -> int:
        """Bytes one token's rows of K and V take over all layers (``kv_heads``: a rank's share)."""
        h, d = kv_heads or self.model.num_kv_heads, self.model.head_dim
        return sum(h * (f.k.bytes_per_row(d) + f.v.bytes_per_row(d)) for f in self.layer_formats)

    def policy_summary(self) -> str:
        """``"int2 (28 layers K, 30 V), int4 (2 K)"``-style count of layers per format."""
        d = self.model.head_dim
        count: dict[str, list[int]] = {}
        for f in self.layer_formats:
            for side, rf in (("K", f.k), ("V", f.v)):
                c = count.setdefault(rf.name(d), [0, 0])
                c[side == "V"] += 1
        parts = []
        for name, (k, v) in sorted(count.items(), key=lambda kv: (-sum(kv[1]), kv[0])):
            sides = ", ".join(f"{n} {side}" for n, side in ((k, "K"), (v, "V")) if n)
            parts.append(f"{name} ({sides})")
        return ", ".join(parts)

    def for_kv_heads(self, heads: list[int], padding: int = 0) -> "RotationArtifacts":
        """A copy whose layers hold only KV heads ``heads`` (a tensor-parallel rank's share), then ``padding``
        neutral heads (identity rotations, no mean, clip and scale 1) for heads that hold no model weights.

        Rotations are per KV head, so a rank's slice is exact. The fingerprint
        stays the whole model's; the copy is for serving, not for ``save``.
        """
        from dataclasses import replace

        index = torch.tensor(heads, dtype=torch.long)
        d = self.model.head_dim

        def neutral(name: str, like: torch.Tensor) -> torch.Tensor:
            if name.endswith("rotation"):
                return torch.eye(d, dtype=like.dtype, device=like.device).expand(padding, d, d)
            fill = torch.zeros if name == "k_mean" else torch.ones
            return fill((padding, *like.shape[1:]), dtype=like.dtype, device=like.device)

        layers = []
        for lr in self.layers:
            parts = {n: getattr(lr, n).index_select(0, index) for n in LayerRotation.TENSOR_NAMES}
            if padding:
                parts = {n: torch.cat([t, neutral(n, t)]) for n, t in parts.items()}
            layers.append(LayerRotation(**parts))
        return replace(self, layers=layers)

    def with_formats(self, formats: list[LayerFormat] | None) -> "RotationArtifacts":
        """A copy whose layers store their rows in ``formats`` (validated)."""
        from dataclasses import replace

        out = replace(self, formats=None if formats is None else list(formats))
        out.validate()
        return out

    def validate(self, where: str = "rotation artifacts") -> None:
        """Raise :class:`ArtifactError` unless every tensor and default is servable."""
        fp = self.model
        if len(self.layers) != fp.num_layers:
            raise ArtifactError(f"{where}: has {len(self.layers)} layers but the model fingerprint says {fp.num_layers}")
        try:
            check_shape(fp.head_dim, self.group)
        except ValueError as e:
            raise ArtifactError(f"{where}: {e}") from None
        if self.sink < 0 or self.recent < 0:
            raise ArtifactError(f"{where}: sink ({self.sink}) and recent ({self.recent}) windows must be >= 0")
        if self.formats is not None:
            if len(self.formats) != fp.num_layers:
                raise ArtifactError(f"{where}: row formats for {len(self.formats)} layers but the model has "
                                    f"{fp.num_layers}")
            for i, lf in enumerate(self.formats):
                for side, rf in (("k", lf.k), ("v", lf.v)):
                    try:
                        rf.resolved(fp.head_dim)
                    except ValueError as e:
                        raise ArtifactError(f"{where}: layer {i} {side} format: {e}") from None
        for i, layer in enumerate(self.layers):
            for name, shape in LayerRotation.expected_shapes(fp.num_kv_heads, fp.head_dim).items():
                t = getattr(layer, name)
                key = f"layers.{i}.{name}"
                if tuple(t.shape) != shape:
                    raise ArtifactError(f"{where}: {key} has shape {tuple(t.shape)}, expected {shape} "
                                        f"(kv_heads={fp.num_kv_heads}, head_dim={fp.head_dim})")
                if not torch.isfinite(t).all():
                    raise ArtifactError(f"{where}: {key} contains NaN or inf")
            for name in ("k_rotation", "v_rotation"):
                err = rot.orthogonality_error(getattr(layer, name)).max().item()
                if err > ORTHOGONALITY_TOL:
                    raise ArtifactError(f"{where}: layers.{i}.{name} is not orthogonal "
                                        f"(max |R^T R - I| = {err:.3g} > {ORTHOGONALITY_TOL:g})")
            for name in ("k_clip", "v_clip"):
                c = getattr(layer, name)
                if ((c <= 0) | (c > 1)).any():
                    raise ArtifactError(f"{where}: layers.{i}.{name} has clip ratios outside (0, 1]: {c.tolist()}")
            lo, hi = KEY_SCALE_BOUNDS
            s = layer.k_scale
            if ((s < lo) | (s > hi)).any():
                raise ArtifactError(f"{where}: layers.{i}.k_scale has key channel scales outside [{lo:g}, {hi:g}] "
                                    f"(min {s.min().item():.3g}, max {s.max().item():.3g})")


def save(art: RotationArtifacts, directory: str | os.PathLike) -> Path:
    """Validate and write ``directory/manifest.json`` and ``directory/rotations.safetensors``."""
    from safetensors.torch import save_file

    out = Path(directory)
    art.validate(str(out))
    out.mkdir(parents=True, exist_ok=True)
    scaled = any(layer.scaled for layer in art.layers)
    names = LayerRotation.TENSOR_NAMES if scaled else LayerRotation.UNSCALED_NAMES
    tensors = {
        f"layers.{i}.{name}": getattr(layer, name).detach().to("cpu", torch.float32).contiguous()
        for i, layer in enumerate(art.layers)
        for name in names
    }
    # Each file is written beside its final name and moved over it (os.replace), and the manifest records the
    # tensors' sha256: an interrupted or concurrent write leaves the old pair, or a pair that :func:`load`
    # refuses, never a manifest describing other tensors (e.g. another layer's formats).
    tmp_tensors, tmp_manifest = (out / f".{name}.{os.getpid()}.tmp" for name in (TENSORS, MANIFEST))
    try:
        save_file(tensors, str(tmp_tensors))
        _write_manifest(art, _sha256(tmp_tensors), tmp_manifest)
        # safetensors creates its file readable by its owner only; the manifest's mode follows the umask, as a
        # server run by another user (a service account) needs for both
        os.chmod(tmp_tensors, tmp_manifest.stat().st_mode & 0o777)
        os.replace(tmp_tensors, out / TENSORS)   # both written in full first: only the two renames in between
        os.replace(tmp_manifest, out / MANIFEST)
    finally:
        for tmp in (tmp_tensors, tmp_manifest):
            tmp.unlink(missing_ok=True)
    return out


def _write_manifest(art: RotationArtifacts, digest: str, path: Path) -> None:
    scaled = any(layer.scaled for layer in art.layers)
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION if scaled else 2,
        "method": art.method,
        "model": asdict(art.model),
        "defaults": {"sink": art.sink, "recent": art.recent, "group_size": art.group},
        "bits_per_element": round(art.bits_per_element, 6),
        "layer_formats": [lf.to_json() for lf in art.layer_formats],
        "calibration": art.calibration,
        "tensors_sha256": digest,
    }
    path.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _inside(root: Path, path: Path) -> Path:
    """``path`` itself, refused when it (through links) resolves outside ``root`` or is not a plain file."""
    real = path.resolve()
    if not real.is_relative_to(root.resolve()):
        raise ArtifactError(f"{path}: points outside the rotations directory (to {real}); refusing to read it")
    return path


def _read_manifest(path: Path) -> dict:
    if not path.is_file():
        raise ArtifactError(f"{path}: missing; a rotations directory needs {MANIFEST} and {TENSORS} "
                            "(create one with oscar-calibrate)")
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise ArtifactError(f"{path}: {size} bytes, more than a manifest can be ({MAX_MANIFEST_BYTES})")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise ArtifactError(f"{path}: not an oscar-sglang rotations manifest (format must be {FORMAT_NAME!r})")
    version = manifest.get("format_version")
    if version not in READABLE_VERSIONS:
        raise ArtifactError(f"{path}: unknown format_version {version!r}; this oscar-sglang reads versions "
                            f"{', '.join(map(str, READABLE_VERSIONS))} (re-run oscar-calibrate with this version)")
    for key in ("method", "model", "defaults"):
        if key not in manifest:
            raise ArtifactError(f"{path}: missing the {key!r} entry")
    if not isinstance(manifest["model"], dict) or not isinstance(manifest["defaults"], dict):
        raise ArtifactError(f"{path}: 'model' and 'defaults' must be JSON objects")
    for key, bound in FINGERPRINT_BOUNDS.items():
        value = manifest["model"].get(key)
        if type(value) is not int or not 0 < value <= bound:
            raise ArtifactError(f"{path}: model.{key} must be an integer in [1, {bound}], got {value!r}")
    for key in ("sink", "recent", "group_size"):
        value = manifest["defaults"].get(key)
        if value is not None and (type(value) is not int or not 0 <= value <= 1 << 24):
            raise ArtifactError(f"{path}: defaults.{key} must be an integer in [0, {1 << 24}], got {value!r}")
    if version >= 2:
        manifest["layer_formats"] = _read_layer_formats(path, manifest)
    else:
        manifest.pop("layer_formats", None)
    return manifest


def _read_layer_formats(path: Path, manifest: dict) -> list[LayerFormat]:
    """Version 2's ``layer_formats``: one ``{"k": {"bits", "group"[, "symmetric"]}, "v": ...}`` per layer, bounded
    and checked."""
    entries = manifest.get("layer_formats")
    layers, d = manifest["model"]["num_layers"], manifest["model"]["head_dim"]
    if not isinstance(entries, list) or len(entries) != layers:
        raise ArtifactError(f"{path}: layer_formats must list one entry per layer ({layers}), got "
                            f"{len(entries) if isinstance(entries, list) else type(entries).__name__}")
    out = []
    for i, e in enumerate(entries):
        sides = []
        for side in ("k", "v"):
            f = e.get(side) if isinstance(e, dict) else None
            bits, group = (f.get("bits"), f.get("group")) if isinstance(f, dict) else (None, None)
            sym = f.get("symmetric", False) if isinstance(f, dict) else False
            if (type(bits) is not int or bits not in BITS or type(group) is not int or not 0 < group <= d
                    or type(sym) is not bool or set(f) - {"bits", "group", "symmetric"}):
                raise ArtifactError(f"{path}: layer_formats[{i}].{side} must be {{\"bits\": one of {list(BITS)}, "
                                    f"\"group\": an integer in [1, {d}], optional \"symmetric\": true/false}}, "
                                    f"got {f!r}")
            try:
                sides.append(RowFormat(bits, group, sym).resolved(d))
            except ValueError as err:
                raise ArtifactError(f"{path}: layer_formats[{i}].{side}: {err}") from None
        out.append(LayerFormat(*sides))
    return out


def _tensor_names(version: int) -> tuple[str, ...]:
    return LayerRotation.TENSOR_NAMES if version >= 3 else LayerRotation.UNSCALED_NAMES


def _check_tensor_header(path: Path, fp: ModelFingerprint, version: int = FORMAT_VERSION) -> None:
    """Read only the safetensors header and check it names exactly the expected tensors, shapes and sizes.

    Runs before the tensors are loaded, so a hostile or corrupted file can
    make the loader allocate nothing beyond what the fingerprint implies.
    """
    shapes = LayerRotation.expected_shapes(fp.num_kv_heads, fp.head_dim)
    expected = {f"layers.{i}.{name}": shapes[name] for i in range(fp.num_layers) for name in _tensor_names(version)}
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ArtifactError(f"{path}: unreadable safetensors file (shorter than its 8-byte header length)")
        n = int.from_bytes(raw, "little")
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise ArtifactError(f"{path}: unreadable safetensors file (header of {n} bytes in a {size}-byte file)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ArtifactError(f"{path}: unreadable safetensors file (header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise ArtifactError(f"{path}: unreadable safetensors file (header is not a JSON object)")
    header.pop("__metadata__", None)
    unexpected = sorted(set(header) - set(expected))
    if unexpected:
        raise ArtifactError(f"{path}: unexpected tensors {', '.join(unexpected[:5])}"
                            f"{' ...' if len(unexpected) > 5 else ''} for a model of {fp.num_layers} layers")
    end = 0
    for key, info in header.items():
        shape, dtype, offsets = info.get("shape"), info.get("dtype"), info.get("data_offsets")
        if dtype not in TENSOR_DTYPES:
            raise ArtifactError(f"{path}: {key} has dtype {dtype!r}; expected one of {', '.join(TENSOR_DTYPES)}")
        if not isinstance(shape, list) or tuple(shape) != expected[key]:
            raise ArtifactError(f"{path}: {key} has shape {tuple(shape) if isinstance(shape, list) else shape}, "
                                f"expected {expected[key]} "
                                f"(kv_heads={fp.num_kv_heads}, head_dim={fp.head_dim})")
        nbytes = math.prod(shape) * TENSOR_DTYPES[dtype]
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or offsets[1] - offsets[0] != nbytes or offsets[0] < 0):
            raise ArtifactError(f"{path}: {key} has data offsets {offsets} that do not hold {nbytes} bytes")
        end = max(end, offsets[1])
    if 8 + n + end != size:
        raise ArtifactError(f"{path}: unreadable safetensors file ({size} bytes, but its header describes "
                            f"{8 + n + end}: truncated or padded)")


def load(
    directory: str | os.PathLike,
    expect: ModelFingerprint | None = None,
) -> RotationArtifacts:
    """Load and validate a rotations directory, optionally against the model about to be served."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(directory)
    if not root.is_dir():
        raise ArtifactError(f"{root}: rotations directory does not exist (create one with oscar-calibrate)")
    manifest_path = _inside(root, root / MANIFEST)
    manifest = _read_manifest(manifest_path)
    try:
        fp = ModelFingerprint(**manifest["model"])
    except TypeError as e:
        raise ArtifactError(f"{manifest_path}: malformed model fingerprint ({e})") from None
    if expect is not None:
        diffs = fp.mismatches(expect)
        if diffs:
            raise ArtifactError(f"{manifest_path}: calibrated for a different model: " + "; ".join(diffs))
    tensors_path = _inside(root, root / TENSORS)
    if not tensors_path.is_file():
        raise ArtifactError(f"{tensors_path}: missing; the rotations directory is incomplete")
    version = manifest["format_version"]
    _check_tensor_header(tensors_path, fp, version)
    try:
        tensors = load_file(str(tensors_path))
    except (SafetensorError, OSError, ValueError) as e:
        raise ArtifactError(f"{tensors_path}: unreadable safetensors file ({e})") from None
    recorded = manifest.get("tensors_sha256")   # since 2026-12-07; older artifacts have none
    if recorded is not None and recorded != _sha256(tensors_path):
        raise ArtifactError(f"{tensors_path}: its sha256 is not the one {MANIFEST} records: the two files are not "
                            "from the same oscar-calibrate run (one replaced or edited by hand, or a write cut "
                            "short); calibrate again")
    layers = []
    for i in range(fp.num_layers):
        names = _tensor_names(version)
        missing = [n for n in names if f"layers.{i}.{n}" not in tensors]
        if missing:
            raise ArtifactError(f"{tensors_path}: layer {i} lacks {', '.join(missing)}")
        layers.append(LayerRotation(*(tensors[f"layers.{i}.{n}"].float() for n in names)))
    defaults = manifest["defaults"]
    group = int(defaults.get("group_size") or fp.head_dim)
    art = RotationArtifacts(
        model=fp,
        method=str(manifest["method"]),
        layers=layers,
        sink=int(defaults.get("sink", DEFAULT_SINK)),
        recent=int(defaults.get("recent", DEFAULT_RECENT)),
        group_size=None if group == fp.head_dim else group,
        calibration=manifest.get("calibration", {}),
        formats=manifest.get("layer_formats"),
    )
    art.validate(str(tensors_path))
    return art


# ---------------------------------------------------------------------------
# Builders that need no calibration data: the baselines.


def _uniform(fp: ModelFingerprint, method: str, r: torch.Tensor, **kw) -> RotationArtifacts:
    kv, d = fp.num_kv_heads, fp.head_dim
    r = r.to(torch.float32).expand(kv, d, d).clone()
    layers = [
        LayerRotation(r.clone(), r.clone(), torch.zeros(kv, d), torch.ones(kv), torch.ones(kv))
        for _ in range(fp.num_layers)
    ]
    return RotationArtifacts(model=fp, method=method, layers=layers, **kw)


def identity(fp: ModelFingerprint, **kw) -> RotationArtifacts:
    """Naive INT2: no rotation, no centering, no clipping."""
    return _uniform(fp, "identity", torch.eye(fp.head_dim), **kw)


def hadamard(fp: ModelFingerprint, **kw) -> RotationArtifacts:
    """QuaRot-style data-blind rotation ``R = H`` for every layer and KV head."""
    return _uniform(fp, "hadamard", rot.hadamard(fp.head_dim), **kw)


BUILDERS = {"identity": identity, "hadamard": hadamard}
