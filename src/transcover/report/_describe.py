"""``describe``: the tensor -> role mapping of a model, read without measuring anything."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Description", "describe_spec"]


@dataclass(frozen=True)
class Description:
    """Which checkpoint tensor plays which role in the seed's decomposition (a dry run of analyze)."""

    model: str
    arch: str
    d_model: int
    n_layers: int
    rows: tuple[tuple[str, str, str], ...]  # (where, role, tensor)
    warnings: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return (f"<Description {self.model!r} ({self.arch}): {self.n_layers} layers, d={self.d_model}, "
                f"{len(self.rows)} tensors mapped; .to_dataframe() or str() for the table>")

    def __str__(self) -> str:
        width = max((len(r) for _, r, _ in self.rows), default=4)
        lines = [f"{self.model} ({self.arch}, {self.n_layers} layers, d={self.d_model})"]
        lines += [f"  {w:>10}  {r:<{width}}  {t}" for w, r, t in self.rows]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def to_dataframe(self):
        import pandas as pd

        return pd.DataFrame(list(self.rows), columns=["where", "role", "tensor"])

    def _repr_html_(self) -> str:
        from ._html import table, text

        return (f"<p><b>{text(self.model)}</b> ({text(self.arch)}, {self.n_layers} layers)</p>"
                + table(("where", "role", "tensor"), self.rows))


def describe_spec(spec) -> Description:
    rows: list[tuple[str, str, str]] = []
    for role, name in (spec.config.get("embedding_names") or {}).items():
        rows.append(("embeddings", str(role), str(name)))
    for layer in spec.layers:
        for role, name in layer.names.items():
            rows.append((f"layer {layer.index}", str(role), str(name)))
    return Description(spec.name, spec.arch, spec.d_model, len(spec.layers), tuple(rows), tuple(spec.warnings))
