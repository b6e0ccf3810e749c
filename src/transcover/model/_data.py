"""Real inputs for the local bounds: token ids, embeddings or texts -> embedded sequences (issue 12).

``load_inputs(spec, source)`` returns a list of float64 ``(T, d)`` tensors: the embedded tokens a
model's first stage (its input norm, then layer 0) receives.  Sources:

* ``.npy`` of integers ``(n, T)``: token ids, embedded with the model's tables (rows of different lengths:
  pad with -1 at the end, dropped before embedding);
* ``.npy`` of floats ``(n, T, d)`` (or ``(T, d)``): embeddings, used as they are (rows of different lengths: pad with
  rows of NaN at the end, dropped);
* for a model with an input embedding ``d_in × d`` (the reference model, ``transcover train``'s
  checkpoints), ``.npy`` of floats ``(n, T, d_in)`` instead: the model's raw inputs (digits rows,
  a sparse task's token codes), embedded by ``X W_in`` plus its positions in float64 (THEORY F104; always
  read so, also when ``d_in = d``: such a model's embeddings are not something a user holds);
* the same arrays in memory (a numpy array, a torch tensor, nested lists), read exactly as from a ``.npy``;
* ``.txt``: one text per line, tokenised with the model's own ``tokenizer.json``;
* ``sklearn-descr``: sentences of the dataset descriptions scikit-learn ships
  (``sklearn/datasets/descr/*.rst``), real English text that needs no download.

Embedding (BERT): word + position + token type 0; the embedding LayerNorm is the spec's
``input_norm`` and is applied by the network, not here.  Every malformed input raises
:class:`~transcover._errors.InputError` with one line naming the problem.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .._errors import InputError
from ._files import read_recorded, read_text
from ._spec import TransformerSpec

__all__ = ["load_inputs", "inputs_from_array", "sklearn_sentences", "tokenize_texts", "embed_ids", "SKLEARN_DESCR",
           "data_files", "BuiltinData"]

SKLEARN_DESCR = "sklearn-descr"
PAD_ID = -1  # trailing entries of a token-id row that are not tokens


def _pad_offset(spec: TransformerSpec) -> int | None:
    """The padding index RoBERTa's positions start after (the adapter's ``position_padding_idx``), else None."""
    pad = spec.config.get("position_padding_idx") if isinstance(spec.config, dict) else None
    return None if pad is None else int(pad)


def _position_ids(spec: TransformerSpec, r: np.ndarray) -> np.ndarray:
    pad = _pad_offset(spec)
    if pad is None:
        return np.arange(r.size)
    keep = (r != pad).astype(np.int64)
    return np.cumsum(keep) * keep + pad


def _max_positions(spec: TransformerSpec) -> int | None:
    """The longest sequence the model's bounds cover: its absolute position table's rows (less RoBERTa's
    offset), and the smallest RoPE ``max_position`` (B_KQ and the Lipschitz chain are suprema over the offsets below
    it: a 20-token sequence of a Llama with 16 positions was certified with them, red team 183); None without
    either."""
    limits = []
    pos = spec.embeddings.get("position_embedding") if "position_embedding" in spec.embeddings else None
    if pos is not None:
        pad = _pad_offset(spec)
        limits.append(int(pos.shape[0]) - (0 if pad is None else pad + 1))
    limits += [int(layer.attention.rope.max_position) for layer in spec.layers
               if getattr(layer.attention, "rope", None) is not None]
    return min(limits) if limits else None


def max_sequence_length(*specs: TransformerSpec) -> int | None:
    """The longest sequence the bounds of every one of ``specs`` cover (a position table's rows, the smallest RoPE
    ``max_position``), or None when nothing limits it."""
    limits = [p for p in map(_max_positions, specs) if p is not None]
    return min(limits) if limits else None


def default_sequence_length(default: int, *specs: TransformerSpec) -> int:
    """A command's default T, shrunk to what ``specs`` cover (a 128-token default of a 16-position model is 16)."""
    return min(default, max_sequence_length(*specs) or default)


def sequence_length(given: int | None, default: int, option: str, spec: TransformerSpec,
                    *others: TransformerSpec) -> int:
    """The T a command runs at: ``given`` (checked, ``check_sequence_length``), or ``default`` shrunk to what the
    models cover (``default_sequence_length``).  The one resolution of every command's and API function's T."""
    T = given or default_sequence_length(default, spec, *others)
    check_sequence_length(spec, T, option, *others)
    return T


def sequence_too_long(T: int, limit: int, what: str, option: str, rope: bool) -> str:
    """The one-line refusal of ``T`` tokens beyond ``limit`` (``check_sequence_length`` and the bounds' own check in
    ``lipschitz._compose``)."""
    why = ("its RoPE bounds are suprema over the offsets below max_position" if rope
           else "its position table has no row beyond")
    return f"{option}={T} is longer than the {limit} tokens {what} covers ({why}); use {option} <= {limit}"


def check_sequence_length(spec: TransformerSpec, T: int, option: str = "seq_len", *others: TransformerSpec) -> None:
    """:class:`InputError` when sequences of ``T`` tokens are longer than ``spec``'s bounds cover (``_max_positions``:
    its position table, or the RoPE offsets B_KQ is the supremum over).  Every bound stated for T tokens (a covering
    number of n x T points, a Frobenius-metric constant, a lower search beside a certified upper) calls it: ``bound
    --seq-len 1000`` of a Llama with 64 positions printed a certified log N whose B_KQ (0.34, the sup over offsets
    below 64) is 3.7x under the score matrix's norm at offset 999 (red team 189; THEORY F110).  ``option`` names the
    setting; ``others``: further models the same T goes through (``perturb``'s second model, red team 197)."""
    for s in (spec, *others):
        n_pos = _max_positions(s)
        if n_pos is not None and int(T) > n_pos:
            rope = any(getattr(layer.attention, "rope", None) is not None for layer in s.layers)
            raise InputError(sequence_too_long(T, n_pos, s.name, option, rope))


def _need_token_table(spec: TransformerSpec) -> None:
    """Token ids and texts need the model's token table: one line naming what the model reads instead."""
    if "token_embedding" not in spec.embeddings:
        d_in = _input_width(spec)
        what = (f"its raw inputs (.npy float, (n, T, {d_in})) or 'task' for a training run" if d_in is not None
                else f"embeddings (.npy float, (n, T, {spec.d_model}))")
        raise InputError(f"{spec.name} has no token embedding table, so token ids and texts cannot be read; "
                         f"give {what}")


def embed_ids(spec: TransformerSpec, ids: np.ndarray) -> list:
    """Token-id rows -> embedded sequences (float64 torch tensors, one per row)."""
    import torch

    _need_token_table(spec)
    E = spec.embeddings["token_embedding"]
    vocab = int(E.shape[0])
    rows = [np.asarray(r) for r in ids]
    if not rows:
        raise InputError("the data is empty (no sequences)")
    empty = [k for k, r in enumerate(rows) if r.size == 0]
    if empty:  # an all-pad row was refused without saying which (stop 39's list)
        raise InputError(f"sequence {empty[0]} of the data is empty (no token, or only {PAD_ID} pads)"
                         + (f"; {len(empty) - 1} more are" if len(empty) > 1 else ""))
    lo, hi = min(int(r.min()) for r in rows), max(int(r.max()) for r in rows)
    if lo < 0 or hi >= vocab:
        raise InputError(f"token ids must lie in [0, {vocab - 1}] (the model's vocabulary; {PAD_ID} pads only at the "
                         f"end of a row), but got ids in [{lo}, {hi}]")
    n_pos = _max_positions(spec)
    longest = max(r.size for r in rows)
    if n_pos is not None and longest > n_pos:
        raise InputError(f"a sequence has {longest} tokens, more than the model allows ({n_pos} positions; texts are "
                         "truncated to --max-len)")
    Et = torch.as_tensor(np.asarray(E), dtype=torch.float64)
    P = spec.embeddings.get("position_embedding") if "position_embedding" in spec.embeddings else None
    S = spec.embeddings.get("token_type_embedding") if "token_type_embedding" in spec.embeddings else None
    out = []
    Pn = None if P is None else np.asarray(P)  # read once, not per row
    for r in rows:
        X = Et[torch.as_tensor(r.astype(np.int64))]
        if Pn is not None:
            X = X + torch.as_tensor(Pn[_position_ids(spec, r)], dtype=torch.float64)
        if S is not None:
            X = X + torch.as_tensor(np.asarray(S[0]), dtype=torch.float64)[None, :]
        out.append(X)
    return out


def _tokenizer_path(spec: TransformerSpec) -> Path:
    """Where the model's ``tokenizer.json`` lies (beside its weights), whether or not it is there."""
    from ._load import BUNDLED_NAME, bundled_model_dir

    base = bundled_model_dir() if spec.name == BUNDLED_NAME else Path(spec.name)
    if base.is_file():
        base = base.parent
    return base / "tokenizer.json"


def _tokenizer_file(spec: TransformerSpec) -> Path:
    path = _tokenizer_path(spec)
    if not path.exists():
        raise InputError(f"no tokenizer.json beside the model {spec.name}; give token ids or embeddings (.npy)")
    return path


@dataclass(frozen=True)
class BuiltinData:
    """A data set that ships with an installed package (``sklearn-descr``), not a file the user gave: the JSON
    envelope names it with ``sha256: null`` (``report.input_hashes`` lists an object that is no path by its name)."""

    name: str


def data_files(spec: TransformerSpec, source: object) -> list:
    """What :func:`load_inputs` reads for ``spec`` from ``source``, for the JSON envelope's ``inputs``: the data file
    and, for texts (``.txt``, ``sklearn-descr``), the model's ``tokenizer.json``, which chose the token ids as much
    as the texts did (red team 222: two folders with one set of weights and texts but different tokenizers certified
    different constants under identical input lists); ``sklearn-descr`` as a :class:`BuiltinData`; nothing for an
    array in memory.  Each file was recorded with its identity when read (Note [inputs read] in ``_files``)."""
    if not isinstance(source, (str, os.PathLike)):
        return []
    texts = source == SKLEARN_DESCR or str(source).endswith(".txt")
    tok = _tokenizer_path(spec) if texts and "token_embedding" in spec.embeddings else None
    tokenizer = [tok] if tok is not None and tok.is_file() else []
    if source == SKLEARN_DESCR:
        return [BuiltinData(SKLEARN_DESCR), *tokenizer]
    return [source, *tokenizer]


def tokenize_texts(spec: TransformerSpec, texts: list[str], max_len: int | None = None) -> list[np.ndarray]:
    """Tokenise with the model's own ``tokenizer.json`` (special tokens added), truncated to ``max_len``."""
    from tokenizers import Tokenizer

    texts = [t for t in (s.strip() for s in texts) if t]
    if not texts:
        raise InputError("the data is empty (no non-blank line of text)")
    path = _tokenizer_file(spec)
    try:  # read here, recorded with its identity: the envelope lists it (Note [inputs read] in ``_files``)
        raw = read_text(path)
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"cannot read {path}: {err}") from None
    try:
        tok = Tokenizer.from_str(raw)
    except Exception as err:  # the tokenizers library raises a bare Exception for a malformed file (stop 38)
        raise InputError(f"cannot read {path}: {' '.join(str(err).split())[:200]}") from None
    vocab = int(spec.embeddings["token_embedding"].shape[0]) if "token_embedding" in spec.embeddings else None
    if vocab is not None and tok.get_vocab_size() != vocab:
        raise InputError(f"the tokenizer has {tok.get_vocab_size()} tokens but the model's vocabulary has {vocab}: "
                         "they do not match")
    n_pos = _max_positions(spec)
    limit = max_len if max_len is not None else n_pos
    tok.no_padding()  # the checkpoint's tokenizer may pad to a fixed length; pads are not data
    if limit is not None:
        # red team 213: below the special tokens' count the tokenizers library ignores the limit (--max-len 1 kept
        # all 6 tokens of a line), and at it no word of a text is left ([CLS] [SEP] certified, no warning)
        special = len(tok.encode("", add_special_tokens=True).ids)
        if limit <= special:
            raise InputError(f"max_len (--max-len) {limit} leaves no token of a text beside the tokenizer's {special} "
                             f"special token(s): give at least {special + 1}")
        tok.enable_truncation(max_length=limit)
    out = [np.asarray(e.ids, dtype=np.int64) for e in tok.encode_batch(texts)]
    longest = max(len(ids) for ids in out)
    if limit is not None and longest > limit:  # the library's truncation did not hold: never certify more than asked
        raise InputError(f"the tokenizer returned {longest} tokens for a text truncated to max_len={limit}")
    return out


def sklearn_sentences(min_words: int = 4) -> list[str]:
    """Sentences of scikit-learn's dataset descriptions (``sklearn/datasets/descr/*.rst``), in a fixed order.

    Lines of markup (tables, directives, headings, references) are dropped; the prose is split at
    sentence ends and sentences with fewer than ``min_words`` words are skipped.
    """
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise InputError("scikit-learn is not installed: --data sklearn-descr needs its dataset descriptions")
    folder = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "descr"
    out: list[str] = []
    for path in sorted(folder.glob("*.rst")):
        prose = []
        for line in path.read_text(encoding="utf-8").splitlines():
            s = line.strip()
            if not s or s.startswith((".. ", ":", "=", "-", "*", "|", "+", "#", ">>>", "...")) or re.fullmatch(r"[=\-~^*+ ]+", s):
                prose.append("\n")
                continue
            prose.append(s)
        for para in " ".join(prose).split("\n"):  # markup lines end paragraphs (and headings)
            for sent in re.split(r"(?<=[.!?])\s+(?=[A-Z])", re.sub(r"\s+", " ", para)):
                sent = sent.strip()
                if len(sent.split()) >= min_words and re.search(r"[a-z]{3}", sent):
                    out.append(sent)
    return out


def load_inputs(spec: TransformerSpec, source: str, *, max_len: int | None = None, limit: int | None = None) -> list:
    """Embedded sequences (float64 ``(T, d)`` tensors) from ``source`` (see the module docstring)."""
    if not isinstance(source, (str, os.PathLike)):  # an array in memory: read as the same array from a .npy
        return _array_inputs(spec, _in_memory(source), limit)
    if source == SKLEARN_DESCR or str(source).endswith(".txt"):
        _need_token_table(spec)  # before the tokenizer is looked for
    if source == SKLEARN_DESCR:
        texts = sklearn_sentences()
        ids = tokenize_texts(spec, texts[:limit] if limit else texts, max_len or 32)
        return embed_ids(spec, ids)
    path = Path(source)
    if not path.exists():
        raise InputError(f"--data: no such file: {source}")
    if path.suffix == ".txt":
        try:  # recorded with its identity when read (Note [inputs read] in ``_files``)
            texts = read_text(path).splitlines()
        except UnicodeDecodeError:
            raise InputError(f"--data: {source} is not UTF-8 text") from None
        ids = tokenize_texts(spec, texts, max_len)
        return embed_ids(spec, ids[:limit] if limit else ids)
    if path.suffix != ".npy":
        raise InputError(f"--data must be a .npy array, a .txt file or {SKLEARN_DESCR}, but got {source}")
    try:  # recorded with its identity when read (Note [inputs read] in ``_files``)
        arr = read_recorded(path, lambda f: np.load(f, allow_pickle=False))
    except (ValueError, OSError, EOFError) as e:  # EOFError: a 0-byte file
        why = ("not a .npy array, or an object array, which is never unpickled" if "pickle" in str(e) else str(e))
        raise InputError(f"--data: cannot read {source} as a numpy array ({why})") from None
    return _array_inputs(spec, arr, limit)


def _in_memory(data: object) -> np.ndarray:
    """``data`` given in memory (a numpy array, a torch tensor, nested lists) as the numpy array a .npy of it holds;
    anything else refused in one line (red team 216: an array failed deep in a comparison, a list in pathlib)."""
    if type(data).__module__.startswith("torch"):
        import torch

        if isinstance(data, torch.Tensor):  # bfloat16 has no numpy dtype: float32 holds it exactly
            data = (data.float() if data.dtype == torch.bfloat16 else data).detach().cpu().numpy()
    if isinstance(data, (list, tuple)):
        try:
            data = np.asarray(data)
        except ValueError:
            raise InputError("data: nested lists of different lengths are no array; pad token ids with -1 and "
                             "embeddings with rows of NaN") from None
    if not isinstance(data, np.ndarray):
        raise InputError(f"data must be a path, {SKLEARN_DESCR!r}, a numpy array, a torch tensor or a list, but got "
                         f"a {type(data).__name__}")
    return data


def _array_inputs(spec: TransformerSpec, arr: np.ndarray, limit: int | None) -> list:
    """The sequences of an id or embedding array (read from a .npy or given in memory), every check applied."""
    if arr.size == 0:
        raise InputError("the data is empty (an array with no entries)")
    # --limit counts sequences: the one-sequence forms get their leading axis first (it cut a (T,) id array or a
    # (T, d) embedding to its first tokens, stop 38 red team)
    if np.issubdtype(arr.dtype, np.integer):
        if arr.ndim == 1:
            arr = arr[None]
        if arr.ndim != 2:
            raise InputError(f"token ids must have shape (n, T), but got {arr.shape}")
        _check_unsigned_pads(arr)
        # sequences of different lengths: -1 pads at the end of a row are dropped (a pad id would be certified as a
        # token the model attends to, another function than the unpadded sequence's)
        return embed_ids(spec, [_strip_pads(r) for r in (arr[:limit] if limit else arr)])
    if not np.issubdtype(arr.dtype, np.floating) or arr.dtype.itemsize > 8:  # float128: torch has no such dtype
        raise InputError("--data arrays must be integer token ids or float16/32/64 embeddings, "
                         f"but got dtype {arr.dtype}")
    if arr.ndim == 2:
        width = _input_width(spec) or spec.d_model
        if arr.shape[-1] != width and np.array_equal(arr, np.round(arr)):
            raise InputError(f"--data: a float array of shape {arr.shape} looks like token ids; token ids must be an "
                             f"integer array (float inputs need width {width})")
        arr = arr[None]
    if limit:
        arr = arr[:limit]
    return inputs_from_array(spec, arr)


def _check_unsigned_pads(arr: np.ndarray) -> None:
    """Refuse an unsigned id array holding its dtype's largest value: a ``PAD_ID`` (-1) stored in an unsigned dtype
    wraps to exactly that value (255 for uint8), which was then read as a real token (stop 39's list)."""
    if arr.dtype.kind != "u":
        return
    top = np.iinfo(arr.dtype).max
    hit = np.argwhere(arr == top)
    if hit.size:
        k, t = (int(v) for v in hit[0])
        raise InputError(f"token ids: sequence {k} holds {top} at position {t}, the largest {arr.dtype} value, "
                         f"which is what a {PAD_ID} pad becomes in an unsigned array; store ids in a signed integer "
                         "dtype")


def _strip_pads(row: np.ndarray) -> np.ndarray:
    """``row`` without its trailing ``PAD_ID`` entries (a pad inside the row stays, and is refused as an id)."""
    keep = len(row)
    while keep and row[keep - 1] == PAD_ID:
        keep -= 1
    return row[:keep]


def _input_width(spec: TransformerSpec) -> int | None:
    """``d_in`` of a model whose first map is an input embedding ``d_in × d``, else None."""
    W = spec.embeddings.get("input_embedding") if "input_embedding" in spec.embeddings else None
    return None if W is None else int(W.shape[0])


def inputs_from_array(spec: TransformerSpec, arr: np.ndarray) -> list:
    """Float sequences -> the float64 ``(T, d)`` tensors the first stage receives, every check applied:
    ``(n, T, d)`` embeddings, or for a model with an input embedding ``d_in × d`` its raw inputs
    ``(n, T, d_in)``, embedded here."""
    import torch

    d_in = _input_width(spec)
    if arr.ndim != 3 or arr.shape[-1] != (spec.d_model if d_in is None else d_in):
        what = (f"embeddings must have shape (n, T, {spec.d_model})" if d_in is None else
                f"inputs must have shape (n, T, {d_in}) (the model's raw inputs, before its input embedding)")
        raise InputError(f"{what} for this model, but got {arr.shape}")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise InputError(f"the data is empty (an array of shape {arr.shape})")
    # sequences of different lengths: rows of NaN at the end of a sequence are padding, dropped (as -1 in token ids);
    # a float array could not express them before, so every sequence had one length
    seqs = [_strip_nan_rows(a, k) for k, a in enumerate(arr)]
    n_pos = _max_positions(spec)
    longest = max(len(a) for a in seqs)
    if longest < arr.shape[1]:  # nothing was padded to this length: NaN from upstream (an overflow), not padding
        raise InputError(f"every sequence of the data ends in rows of NaN (the longest has {longest} of "
                         f"{arr.shape[1]} tokens): rows of NaN pad shorter sequences to the longest one, so these are "
                         "not padding")
    if n_pos is not None and longest > n_pos:
        raise InputError(f"a sequence has {longest} tokens, more than the model allows ({n_pos} positions)")
    if d_in is not None:
        if d_in == spec.d_model:  # one width, two readings: say which one is taken (stop 39 red team)
            import warnings

            from .._errors import TranscoverWarning

            warnings.warn(f"--data width {d_in} is both {spec.name}'s raw input width and its embedding width; read "
                          "as raw inputs, embedded by the model's input embedding", TranscoverWarning, stacklevel=2)
        W = torch.as_tensor(np.asarray(spec.embeddings["input_embedding"]), dtype=torch.float64)
        P = (torch.as_tensor(np.asarray(spec.embeddings["position_embedding"]), dtype=torch.float64)
             if "position_embedding" in spec.embeddings else None)
        embedded = []
        for a in seqs:
            X = torch.as_tensor(a, dtype=torch.float64) @ W
            X = X if P is None else X + P[: len(a)]
            if not bool(torch.isfinite(X).all()):
                raise InputError("the inputs are too large: their embedding overflows float64")
            embedded.append(X.numpy())
        seqs = embedded
    out = []
    for a in seqs:
        # a token norm beyond float64 was reported as "radius=inf" (stop 38 red team); formed at each token's largest
        # entry (np.linalg.norm squares unscaled, which refused norms ~1e200 that float64 holds)
        big = np.abs(a.astype(np.float64)).max(axis=-1, keepdims=True)
        scaled = np.where(big > 0, a / np.where(big > 0, big, 1.0), 0.0)
        with np.errstate(over="ignore"):
            if not np.isfinite(big[..., 0] * np.linalg.norm(scaled, axis=-1)).all():
                raise InputError("the embeddings are too large: a token's l2 norm overflows float64")
        out.append(torch.as_tensor(a, dtype=torch.float64))
    return out


def _strip_nan_rows(a: np.ndarray, k: int) -> np.ndarray:
    """Sequence ``k`` (T, width) without its trailing all-NaN rows (padding); any other NaN or infinity refused, and
    a sequence of padding only."""
    keep = len(a)
    while keep and np.isnan(a[keep - 1]).all():
        keep -= 1
    if keep == 0:
        raise InputError(f"sequence {k} of the data is padding only (every row NaN)")
    if not np.isfinite(a[:keep]).all():
        raise InputError(f"sequence {k} contains NaN or infinite values (rows of NaN are allowed only at its end, as "
                         "padding of sequences of different lengths)")
    return a[:keep]


def median_token_norm(seqs: list) -> float:
    """Median l2 norm of the tokens (the scale of the rho sweep)."""
    import torch

    return float(torch.cat([s.norm(dim=1) for s in seqs]).median()) if seqs else math.nan
