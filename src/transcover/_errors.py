"""The one exception family transcover raises for problems a user can fix.

Every user-facing error is a :class:`TranscoverError` (a ``ValueError``) whose message is one line
that names the offending file, tensor, argument or value.  The CLI prints exactly that line and
exits non-zero; ``--debug`` shows the traceback.
"""

from __future__ import annotations

__all__ = ["TranscoverError", "InputError", "UnsupportedArchitectureError", "WeightError", "CertificateViolation"]


class TranscoverError(ValueError):
    """Base class: a problem with what the user asked for or supplied."""


class InputError(TranscoverError):
    """A missing, unreadable or corrupted file, or an invalid argument value."""


class UnsupportedArchitectureError(TranscoverError):
    """The model's architecture has no adapter; the message lists the supported ones."""


class WeightError(TranscoverError):
    """A tensor is missing, has the wrong shape, or holds NaN/Inf; the message names it."""


class CertificateViolation(RuntimeError):
    """A measured lower value exceeds the certified upper bound it sits beside: a false certificate.

    Not a :class:`TranscoverError`: the user did nothing wrong, the bound (or its implementation) is
    wrong.  The CLI reports it as an internal error (one line, exit code 1), never as a table row.
    Raised by :func:`transcover._results.check_certified`.
    """
