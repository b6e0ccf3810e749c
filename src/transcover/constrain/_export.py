"""Remove constraints, or export a plain model computing the same function (cf. torchlip ``vanilla_export``).

Note [certified export]: a spectral or product cap only *estimates* sigma (power iteration), so its
value can sit above its radius (sigma/c up to 1.31 measured in digits training, issue 10).  By
default the exported tensors are therefore certified against each cap's radius with
``transcover.norms`` and, where the certificate exceeds it, projected exactly
(:func:`project_spectral_` & co., certified after the cast).  A model whose caps already hold
(e.g. after :meth:`Constrainer.finalize`) is exported bit for bit; ``certify=False`` always is.

Note [strip order]: a product constraint reads its partner's unconstrained tensor, so removing
parametrizations one at a time would change what the remaining ones compute.  Every constrained
value is therefore computed first (in eval mode: no power-iteration update, so the values are the
ones evaluation uses), then every parametrization is removed, then the values are written back.
"""

from __future__ import annotations

import copy
import weakref
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import parametrize

from ._clip import _NormCap
from ._product import _ProductCapFactor
from ._projection import project_bias_, project_product_, project_spectral_, radius_floor
from ._spectral import _SpectralCap

__all__ = ["strip_constraints", "export_plain", "constrained_tensors", "save_plain"]

_OURS = (_SpectralCap, _ProductCapFactor, _NormCap)


def constrained_tensors(model: nn.Module, *, only_transcover: bool = True) -> list[tuple[nn.Module, str]]:
    """``(module, name)`` of every parametrized tensor (only transcover's constraints by default)."""
    found = []
    for module in model.modules():
        if not parametrize.is_parametrized(module):
            continue
        for name, plist in module.parametrizations.items():
            if not only_transcover or all(isinstance(p, _OURS) for p in plist):
                found.append((module, name))
    return found


def _caps(targets: list[tuple[nn.Module, str]]) -> list[tuple]:
    """What each of transcover's caps on ``targets`` promises: ``(kind, refs, radius, scale)``."""
    caps = []
    for m, n in targets:
        for p in m.parametrizations[n]:
            if isinstance(p, _SpectralCap):
                caps.append(("matrix", ((m, n, None),), radius_floor(p.radius), 1.0))
            elif isinstance(p, _NormCap) and m.parametrizations[n].original.dim() == 1:
                caps.append(("vector", ((m, n, None),), radius_floor(p.radius), 1.0))
            elif isinstance(p, _ProductCapFactor) and "a" in p.sides:
                st = p.state
                caps.append(("product", (st.refs["a"], st.refs["b"]), radius_floor(st.radius), st.scale))
    return caps


def _enforce(caps: list[tuple]) -> None:
    """Project every plain tensor whose certified norm exceeds its cap's radius (Note [certified export])."""
    for kind, refs, radius, scale in caps:
        if kind == "product":
            (ma, na, la), (mb, nb, lb) = refs
            project_product_(la.heads(getattr(ma, na).data), lb.heads(getattr(mb, nb).data), radius, scale)
        elif kind == "matrix":
            project_spectral_(getattr(refs[0][0], refs[0][1]).data, radius)
        else:
            project_bias_(getattr(refs[0][0], refs[0][1]).data, radius)


@torch.no_grad()
def strip_constraints(model: nn.Module, *, only_transcover: bool = True, certify: bool = True) -> nn.Module:
    """Replace every constrained tensor by its constrained value, in place; returns ``model``.

    With ``certify=False`` the model then computes, in eval mode, exactly what it computed before in
    eval mode (the values are copied bit for bit).  With ``certify=True`` (default) every value
    whose certified norm exceeds its cap's radius is then projected onto the ball (Note [certified
    export]), so the plain model satisfies every cap's promise, certified.  Training-mode
    power-iteration updates are gone with the parametrizations.
    """
    targets = constrained_tensors(model, only_transcover=only_transcover)
    caps = _caps(targets) if certify else []
    was_training = model.training
    model.eval()
    values = [getattr(m, n).detach().clone() for m, n in targets]
    for (m, n), value in zip(targets, values):
        parametrize.remove_parametrizations(m, n, leave_parametrized=False)
        getattr(m, n).copy_(value)
    _enforce(caps)
    model.train(was_training)
    return model


def _unshare_parametrized_classes(model: nn.Module) -> None:
    """Give every parametrized module of ``model`` its own class object.

    Note [shared parametrized class]: ``torch.nn.utils.parametrize`` swaps a module's class for a
    generated subclass holding one property per parametrized tensor, and its ``__deepcopy__`` keeps
    that *same* class object for the copy.  Removing a parametrization deletes the property from the
    class, so stripping a deep copy would silently strip the original too.  A fresh class with the
    same dictionary and bases makes the copy independent.
    """
    for m in model.modules():
        if parametrize.is_parametrized(m):
            cls = type(m)
            m.__class__ = type(cls.__name__, cls.__bases__, dict(cls.__dict__))


def export_plain(model: nn.Module, *, certify: bool = True) -> nn.Module:
    """A deep copy of ``model`` without transcover's constraints, computing the same function
    (the projected one where a cap did not hold, unless ``certify=False``; Note [certified export]).

    Example:
        >>> from transcover.constrain import spectral_cap
        >>> lin = spectral_cap(nn.Linear(3, 3), radius=0.1).eval()
        >>> plain = export_plain(lin)
        >>> x = torch.randn(2, 3)
        >>> bool(torch.equal(plain(x), lin(x))), parametrize.is_parametrized(plain)
        (True, False)
    """
    replica = copy.deepcopy(model)
    _unshare_parametrized_classes(replica)
    return strip_constraints(replica, certify=certify)


RAW_STATE_FILE = "transcover_constrained.safetensors"


def _plain_save_pretrained(model: nn.Module, save_directory, *args, **kwargs):
    """``save_pretrained`` of the certified plain export of ``model`` (Note [plain checkpoints]), plus the
    constrained model's own state in ``RAW_STATE_FILE`` beside it (Note [exact trainer resume])."""
    kwargs.pop("state_dict", None)  # the caller's would carry parametrization keys: use the plain one
    plain = export_plain(model)
    plain.__dict__.pop("save_pretrained", None)
    out = type(plain).save_pretrained(plain, save_directory, *args, **kwargs)
    save_raw_state(model, save_directory, plain)
    return out


# Note [exact trainer resume]: a plain checkpoint restores the *function* (each cap leaves a weight inside its
# ball unchanged), not the training state: the unconstrained tensors the optimiser's moments belong to and a
# spectral cap's power-iteration vectors are not in it, so a spectral run resumed from it went on from other
# parameters (stop 39 red team: 0.24 max weight difference after four more steps).  Each save therefore also
# writes the constrained model's ``state_dict`` (originals and the caps' buffers) as RAW_STATE_FILE, and the
# callback loads it back when it resumes (``load_raw_state``), which makes the resumed run the uninterrupted one.
_TRACKERS: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()
_TRACKER_PREFIX = "__transcover_tracker__."  # a penalty's power-iteration state (it lives outside the model)


def track_with(model: nn.Module, tracker: nn.Module | None) -> None:
    """Keep ``tracker``'s state (a penalty's :class:`SigmaTracker`) in ``model``'s RAW_STATE_FILE saves."""
    if tracker is not None:
        _TRACKERS[model] = tracker


def _plain_view(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state as a plain checkpoint names it: each ``<m>.parametrizations.<w>.original`` as ``<m>.<w>``,
    the parametrizations' own buffers left out (they are not in the plain file)."""
    out = {}
    for key, value in model.state_dict().items():
        head, sep, tail = key.partition("parametrizations.")
        if not sep:
            out[key] = value
        elif tail.endswith(".original") and tail.count(".") == 1:
            out[head + tail[: -len(".original")]] = value
    return out


def _digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor of ``state`` (names, dtypes, shapes, bytes), in name order."""
    import hashlib

    h = hashlib.sha256()
    for key in sorted(state):
        t = state[key].detach().to("cpu").contiguous()
        h.update(f"{key}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def save_raw_state(model: nn.Module, folder, plain: nn.Module | None = None) -> Path | None:
    """Write ``model``'s full constrained ``state_dict`` (and a registered tracker's state, ``track_with``) to
    ``folder / RAW_STATE_FILE`` (atomic), tagged with the digest of the plain weights saved beside it (``plain``, the
    export: every tensor of it, so the file belongs to that one checkpoint); None when there is nothing beyond the
    plain file (no parametrization, no tracker)."""
    from safetensors.torch import save

    from .._io import atomic_write_bytes

    tracker = _TRACKERS.get(model)
    if tracker is None and not any(parametrize.is_parametrized(m) for m in model.modules()):
        return None
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}  # shared storage refused
    if tracker is not None:
        state.update({_TRACKER_PREFIX + k: v.detach().clone().contiguous() for k, v in tracker.state_dict().items()})
    plain = export_plain(model) if plain is None else plain
    meta = {"format": "pt", "plain_digest": _digest(plain.state_dict())}
    return atomic_write_bytes(Path(folder) / RAW_STATE_FILE, save(state, metadata=meta))


def expects_raw_state(model: nn.Module) -> bool:
    """Whether ``model``'s saves write RAW_STATE_FILE (a resume without it is then not the uninterrupted run)."""
    return model in _TRACKERS or any(parametrize.is_parametrized(m) for m in model.modules())


def load_raw_state(model: nn.Module, folder) -> bool:
    """Load ``folder / RAW_STATE_FILE`` into ``model`` (and its registered tracker) when it belongs to the plain
    checkpoint ``model`` holds now (every tensor's digest matches); False when the folder has none or it belongs to
    another checkpoint.  After loading, the model's own export must give that digest again: a file damaged after it
    was written is refused and the state before the load restored.

    Raises:
        InputError: an unreadable or damaged file, or one that does not fit ``model``; one line.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    from .._errors import InputError

    path = Path(folder) / RAW_STATE_FILE
    if not path.is_file():
        return False
    try:
        with safe_open(str(path), "pt") as fh:
            digest = (fh.metadata() or {}).get("plain_digest")
        state = load_file(str(path))
    except Exception as err:  # safetensors' own error types for a damaged file
        raise InputError(f"cannot read {path}: {err}") from None
    if digest != _digest(_plain_view(model)):
        return False
    tracker = _TRACKERS.get(model)
    extra = {k[len(_TRACKER_PREFIX):]: state.pop(k) for k in list(state) if k.startswith(_TRACKER_PREFIX)}
    own = model.state_dict()
    bad = sorted(set(own) ^ set(state)) or [k for k in sorted(own) if tuple(own[k].shape) != tuple(state[k].shape)]
    if bad or (tracker is not None) != bool(extra):
        raise InputError(f"{path} does not fit the model being trained (tensor {(bad or ['tracker'])[0]!r}); delete it "
                         "to resume from the plain weights alone")
    before = {k: v.detach().clone() for k, v in own.items()}
    device = next(iter(own.values())).device
    model.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=True)
    if _digest(export_plain(model).state_dict()) != digest:  # the originals no longer export to the saved weights
        model.load_state_dict(before, strict=True)
        raise InputError(f"{path} is damaged: its constrained tensors do not give the plain weights saved beside it; "
                         "delete it to resume from the plain weights alone")
    if tracker is not None:
        tracker.load_state_dict({k: v.to(device) for k, v in extra.items()})
    return True


def _load_plain_into_constrained(module, state_dict, prefix, local_metadata, strict, missing_keys,
                                 unexpected_keys, error_msgs) -> None:
    """Load-state-dict pre-hook: a plain ``<path>.<name>`` feeds ``<path>.parametrizations.<name>.original``."""
    for path, m in module.named_modules(prefix=prefix.rstrip(".")):
        if not parametrize.is_parametrized(m):
            continue
        for name in m.parametrizations:
            base = f"{path}." if path else ""
            plain, original = f"{base}{name}", f"{base}parametrizations.{name}.original"
            if plain in state_dict and original not in state_dict:
                state_dict[original] = state_dict.pop(plain)


def save_plain(model: nn.Module) -> nn.Module:
    """Make ``model.save_pretrained`` write the certified plain export; let plain checkpoints load back.

    Note [plain checkpoints]: a parametrized model's ``state_dict`` holds
    ``...parametrizations.<name>.original`` keys that ``from_pretrained`` does not know, so it
    silently re-initialises those weights (outputs differed by 77 in issue 10).  This installs, on
    this instance only, a ``save_pretrained`` that saves :func:`export_plain` of the model (plain
    weights, certified against every cap's radius, Note [certified export]) -- which is what
    ``transformers.Trainer.save_model`` and its checkpoints call -- and a load-state-dict pre-hook
    that maps plain keys onto the unconstrained tensors, so a plain checkpoint restores the same
    function (a cap leaves a weight already inside its ball unchanged); the constrained state saved
    beside it (``RAW_STATE_FILE``, Note [exact trainer resume]) makes ``resume_from_checkpoint``
    continue exactly as the uninterrupted run.  Idempotent;
    models without ``save_pretrained`` only get the load hook.  Returns ``model``.
    """
    import types

    if getattr(model, "_transcover_plain_save", False):
        return model
    if hasattr(type(model), "save_pretrained"):
        model.save_pretrained = types.MethodType(_plain_save_pretrained, model)
    model.register_load_state_dict_pre_hook(_load_plain_into_constrained)
    model._transcover_plain_save = True
    return model
