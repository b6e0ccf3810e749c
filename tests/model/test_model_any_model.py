"""Any model: per-matrix norms outside the decomposition, roles mapping files, the support table, windows.

* an unknown module or safetensors file: ``analyze`` reports certified per-matrix norms (enclosing
  float64 SVD and the exact entrywise norms in the stated orientation), labelled as outside the
  decomposition; ``lipschitz`` refuses with one line saying how to name the roles;
* a renamed Llama-like checkpoint analysed through a roles mapping gives exactly the llama adapter's
  numbers; bad mappings are one line, exit 2;
* ``analyze --list-archs`` prints the registry's table, which is the README's table verbatim;
* sliding-window attention: G.3 refuses a window mismatch, and the certified Lipschitz bound of a
  windowed model survives the adversarial search on sequences longer than the window.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import randomize

from transcover import InputError, TranscoverWarning, UnsupportedArchitectureError, analyze
from transcover.cli import main
from transcover.model import load, structural_differences

ROOT = Path(__file__).resolve().parents[2]
D, H, H_KV, DFF, L, V = 16, 4, 2, 24, 2, 32


class Conv1D(torch.nn.Module):
    """transformers' GPT-2 Conv1D layout: weight stored (d_in, d_out), x @ W + b."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d_in, d_out, dtype=torch.float64))

    def forward(self, x):
        return x @ self.weight


class Wrap(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(V, D).double()
        self.up = torch.nn.Linear(D, 3 * D).double()
        self.conv = Conv1D(3 * D, D)
        self.head = torch.nn.Linear(D, V, bias=False).double()
        self.head.weight = self.emb.weight  # tied: one matrix


def _exact(W_rv: np.ndarray) -> tuple[float, float, float]:
    return (float(np.linalg.svd(W_rv, compute_uv=False)[0]), float(np.sqrt((W_rv ** 2).sum())),
            float(np.sqrt((W_rv ** 2).sum(axis=0)).sum()))


def _encloses(row, W_rv: np.ndarray) -> None:
    for iv, true in zip((row.spectral, row.frobenius, row.l21), _exact(W_rv)):
        assert iv.kind.value.startswith("certified")
        assert iv.lower <= true * (1 + 1e-12) and true <= iv.upper * (1 + 1e-12), (row.name, iv, true)


def test_unknown_module_gets_certified_per_matrix_norms():
    m = Wrap()
    with pytest.raises(UnsupportedArchitectureError, match="mapping file"):
        load(m)
    r = analyze(m)
    assert [x.name for x in r.matrices] == ["emb.weight", "up.weight", "conv.weight"]  # the tied head once
    assert "outside the decomposition" in r.notes[-1] and "unsupported module Wrap" in r.notes[0]
    assert r.skipped == ("up.bias (48,)",)
    rows = {x.name: x for x in r.matrices}
    _encloses(rows["emb.weight"], m.emb.weight.detach().numpy())  # a token is a row: as stored
    _encloses(rows["up.weight"], m.up.weight.detach().numpy().T)  # nn.Linear: x @ W^T
    _encloses(rows["conv.weight"], m.conv.weight.detach().numpy())  # Conv1D: as stored
    # the (2,1) norm is orientation-dependent: the stored Linear weight would give another value
    stored = m.up.weight.detach().numpy()
    assert abs(float(np.sqrt((stored ** 2).sum(axis=0)).sum()) - rows["up.weight"].l21.upper) > 1e-3


def _unknown_file(tmp_path: Path) -> Path:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    tensors = {"tok_embeddings.weight": torch.randn(V, D, generator=g), "mix.0.proj.weight": torch.randn(D, 2 * D, generator=g),
               "mix.0.proj.bias": torch.randn(D, generator=g), "mix.0.conv.weight": torch.randn(D, D, 3, generator=g)}
    tensors = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
    tensors["mix.position_ids"] = torch.arange(8).reshape(1, 8)  # an integer buffer: skipped, not refused
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mystery"}))
    return tmp_path


def test_unknown_file_per_matrix_and_cli(tmp_path, capsys):
    path = _unknown_file(tmp_path)
    r = analyze(path)
    rows = {x.name: x for x in r.matrices}
    assert set(rows) == {"tok_embeddings.weight", "mix.0.proj.weight"}
    from safetensors.torch import load_file

    t = {k: v.double().numpy() for k, v in load_file(path / "model.safetensors").items()}
    _encloses(rows["tok_embeddings.weight"], t["tok_embeddings.weight"])
    _encloses(rows["mix.0.proj.weight"], t["mix.0.proj.weight"].T)
    assert rows["mix.0.proj.weight"].orientation.startswith("linear (assumed")
    assert "mix.position_ids (1, 8) int64" in r.skipped
    out_json = tmp_path / "pm.json"
    assert main(["analyze", str(path), "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "note: unsupported architecture 'mystery'" in text and "outside the decomposition" in text
    doc = json.loads(out_json.read_text())
    assert doc["schema"] == "transcover.analyze.per_matrix" and "outside the decomposition" in doc["scope"]
    assert [m["name"] for m in doc["matrices"]] == [x.name for x in r.matrices]
    assert main(["lipschitz", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unsupported architecture 'mystery'" in err[0] and "--roles" in err[0]
    assert main(["analyze", str(path), "--plot", str(tmp_path / "x.png")]) == 2
    capsys.readouterr()
    assert main(["analyze", str(path), "--fast", "--quiet", "--csv", str(tmp_path / "pm.csv")]) == 0
    lines = (tmp_path / "pm.csv").read_text().splitlines()
    assert len(lines) == 3 and lines[0].startswith("name,shape,orientation,kind,spectral_lower")
    assert all(",certified" in line for line in lines[1:])


def _llama(transformers_mod, window: int | None = None):
    cfg = transformers_mod.LlamaConfig(
        hidden_size=D, num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=H_KV, intermediate_size=DFF,
        vocab_size=V, rms_norm_eps=1e-5, max_position_embeddings=16, bos_token_id=0, eos_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}, attn_implementation="sdpa")
    torch.manual_seed(0)
    return randomize(transformers_mod.LlamaForCausalLM(cfg), seed=3).eval()


_RENAME = [(r"model\.layers\.(\d+)\.self_attn\.([qkvo])_proj", r"blk.\1.attn.w\2"),
           (r"model\.layers\.(\d+)\.mlp\.gate_proj", r"blk.\1.ff.gate"), (r"model\.layers\.(\d+)\.mlp\.up_proj", r"blk.\1.ff.up"),
           (r"model\.layers\.(\d+)\.mlp\.down_proj", r"blk.\1.ff.down"),
           (r"model\.layers\.(\d+)\.input_layernorm", r"blk.\1.n1"), (r"model\.layers\.(\d+)\.post_attention_layernorm", r"blk.\1.n2"),
           (r"model\.norm", "out_norm"), (r"model\.embed_tokens", "tok"), (r"lm_head", "unembed")]
ROLES = {"layers": "blk.{i}.", "n_heads": H, "n_kv_heads": H_KV, "placement": "pre", "norm": "rmsnorm", "eps": 1e-5,
         "activation": "silu", "causal": True, "rope_theta": 500.0, "max_position": 16,
         "roles": {"W_Q": "attn.wq.weight", "W_K": "attn.wk.weight", "W_V": "re:attn\\.wv\\.weight",
                   "W_O": "attn.wo.weight", "W_gate": "ff.gate.weight", "W_1": "ff.up.weight", "W_2": "ff.down.weight",
                   "norm_attn.weight": "n1.weight", "norm_ffn.weight": "n2.weight"},
         "final_norm": {"weight": "out_norm.weight"}, "embeddings": {"token_embedding": "tok.weight"}}


def _numbers(doc):
    """The JSON without the checkpoint tensor names (which differ by construction)."""
    if isinstance(doc, dict):
        return {k: _numbers(v) for k, v in doc.items() if k != "tensor"}
    if isinstance(doc, list):
        return [_numbers(v) for v in doc]
    return doc


def _renamed(model, tmp_path: Path) -> Path:
    from safetensors.torch import save_file

    state = {}
    for k, v in model.state_dict().items():
        for pat, rep in _RENAME:
            k = re.sub(pat, rep, k)
        state[k] = v.detach().clone().contiguous()
    save_file(state, tmp_path / "weights.safetensors")
    return tmp_path / "weights.safetensors"


def test_renamed_llama_via_roles_file_matches_the_llama_adapter(transformers_mod, tmp_path, capsys):
    model = _llama(transformers_mod)
    model.save_pretrained(tmp_path / "hf")
    ref = analyze(tmp_path / "hf", embeddings=False)
    path = _renamed(model, tmp_path)
    with pytest.raises(InputError, match="cannot tell the architecture"):
        load(path)
    (tmp_path / "roles.json").write_text(json.dumps(ROLES))
    out = tmp_path / "mapped.json"
    assert main(["analyze", str(path), "--roles", str(tmp_path / "roles.json"), "--no-embeddings", "--quiet",
                 "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert _numbers(got["layers"]) == _numbers(ref.to_dict()["layers"])  # identical certified intervals
    from transcover.model import transformer_forward

    X = torch.randn(1, 7, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    a, b = load(path, roles=ROLES).to_torch(torch.float64), load(tmp_path / "hf").to_torch(torch.float64)
    assert torch.equal(transformer_forward(a, X), transformer_forward(b, X))
    assert main(["analyze", str(path), "--roles", str(tmp_path / "roles.json"), "--describe"]) == 0
    assert "blk.1.ff.gate.weight" in capsys.readouterr().out
    # transcover_roles.json beside the weights: every command reads the layout
    (tmp_path / "transcover_roles.json").write_text(json.dumps(ROLES))
    assert load(path).arch == "mapped"
    capsys.readouterr()
    assert main(["analyze", str(path), str(path), "--roles", str(tmp_path / "roles.json")]) == 2
    assert "--roles applies to one model" in capsys.readouterr().err


def test_every_command_that_reads_a_model_takes_the_roles_mapping(transformers_mod, tmp_path, capsys):
    """``lipschitz``, ``perturb``, ``bound`` and ``report`` had no ``--roles`` (argparse: exit 2, "unrecognized
    arguments"): a layout analysed through a mapping file could not be certified by the same command line.  Each now
    reads the renamed Llama exactly as the llama adapter reads the original, and hashes the mapping file with the
    model in its JSON."""
    model = _llama(transformers_mod)
    model.save_pretrained(tmp_path / "hf")
    path = _renamed(model, tmp_path)
    roles = tmp_path / "roles.json"
    roles.write_text(json.dumps(ROLES))
    fast = ["--samples", "1", "--steps", "1", "--quiet"]
    for cmd, extra in (("lipschitz", fast), ("bound", ["--quiet"]), ("perturb", fast)):
        docs = []
        for src, opts in ((path, ["--roles", str(roles)]), (tmp_path / "hf", [])):
            out = tmp_path / f"{cmd}-{len(docs)}.json"
            models = [str(src)] * (2 if cmd == "perturb" else 1)
            assert main([cmd, *models, *opts, *extra, "--json", str(out)]) == 0, capsys.readouterr().err
            docs.append(json.loads(out.read_text()))
        mapped, ref = docs
        hashed = [i["path"] for i in mapped["inputs"]]
        assert str(roles) in hashed and str(roles) not in [i["path"] for i in ref["inputs"]], (cmd, hashed)
        envelope = {"command_line", "inputs", "model", "model_a", "model_b", "warnings", "arch"}
        numbers = [{k: v for k, v in _numbers(doc).items() if k not in envelope} for doc in docs]
        assert len(numbers[0]) >= 4 and numbers[0] == numbers[1], cmd  # the same certified numbers
    html = tmp_path / "r.html"
    assert main(["report", str(path), "--roles", str(roles), "--no-lower", "--quiet", "-o", str(html)]) == 0
    assert "roles.json" in html.read_text()
    # without the mapping the renamed layout is still refused, naming the way out
    capsys.readouterr()
    assert main(["lipschitz", str(path), *fast]) == 2
    assert "--roles" in capsys.readouterr().err


@pytest.mark.parametrize("bad, message", [
    ({"n_heads": None}, "'n_heads' .* is required"),
    ({"layers": "blk."}, "must be a prefix pattern containing"),
    ({"roles": {**ROLES["roles"], "W_X": "a"}}, "unknown roles"),
    ({"roles": {k: v for k, v in ROLES["roles"].items() if k != "W_O"}}, r"missing roles \['W_O'\]"),
    ({"roles": {**ROLES["roles"], "W_V": "re:attn\\.w.\\.weight"}}, "matches 4 tensors"),
    ({"n_heads": 3, "n_kv_heads": 3}, "is not 3 heads"),
    ({"placement": "sandwich"}, "placement='sandwich'"),
    # red team 37g: internal errors (exit 1) from float()/int()/re.compile, and mappings read silently
    ({"roles": {**ROLES["roles"], "W_V": "re:("}}, "is not a regular expression"),
    ({"eps": "x"}, "'eps' must be a finite number >= 0"),
    ({"rope_theta": -1.0}, "'rope_theta' must be a finite number > 0"),
    ({"n_layers": "2"}, "'n_layers' must be an integer > 0"),
    ({"window": 1.5}, "'window' must be an integer > 0"),
    ({"max_position": True}, "'max_position' must be an integer > 0"),
    ({"scale": -1}, "'scale' must be a finite number > 0"),
    ({"embeddings": ["tok.weight"]}, "'embeddings' must map roles to tensor names"),
    ({"embeddings": {"token_embedding": "nope.weight"}}, "embeddings name 'nope.weight'"),
    ({"causal": "false"}, "'causal' must be true or false"),
    ({"roles": {**ROLES["roles"], "W_K": "attn.wq.weight"}},
     r"'blk\.0\.attn\.wq\.weight' is named by two roles \(W_Q, W_K\)"),
])
def test_bad_roles_mapping_is_one_line_exit_2(transformers_mod, tmp_path, capsys, bad, message):
    path = _renamed(_llama(transformers_mod), tmp_path)
    (tmp_path / "roles.json").write_text(json.dumps({**ROLES, **bad}))
    assert main(["analyze", str(path), "--roles", str(tmp_path / "roles.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err


def test_list_archs_is_the_readme_table(capsys):
    from transcover.model._adapters._support import support_table

    assert main(["analyze", "--list-archs"]) == 0
    printed = capsys.readouterr().out
    table = support_table()
    assert printed == table
    for family in ("distilbert", "clip_text", "clip_vision", "whisper", "deberta_v2", "per-matrix", "mapped"):
        assert f"| `{family}` |" in table
    readme = (ROOT / "README.md").read_text()  # regenerate with scripts/support_table.py
    block = readme.split("<!-- support-table:start -->\n")[1].split("<!-- support-table:end -->")[0]
    assert block == table, "README table is stale: run PYTHONPATH=src python scripts/support_table.py"


def test_support_table_says_how_each_family_is_selected(tmp_path, capsys):
    """red team 217: the column read "family (`--arch`)" while `--arch mapped` and `--arch per-matrix` are refused
    (and `--arch clip`, accepted, had no row); the refusal, printed by analyze, said "`transcover analyze` alone
    reports per-matrix norms"."""
    from transcover.model._adapters._registry import adapter_for
    from transcover.model._adapters._support import families, support_table

    assert support_table().startswith("| family | selected by |")
    for fam in families():
        row = next(line for line in support_table().splitlines() if line.startswith(f"| `{fam.name}` |"))
        if f"`--arch {fam.name}`" in row:
            assert adapter_for(fam.name)[0] == fam.name
        else:
            assert "not an `--arch` value" in row
            with pytest.raises(UnsupportedArchitectureError):
                adapter_for(fam.name)
    assert "`--arch clip`" in support_table()
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2, 2)}, tmp_path / "m.safetensors")
    assert main(["analyze", "--arch", "per-matrix", str(tmp_path / "m.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "unsupported architecture 'per-matrix'" in err and "alone" not in err
    assert "without --arch and --roles, `transcover analyze` reports per-matrix norms" in err


def test_sliding_window_is_structural_and_bounds_hold_beyond_the_window(transformers_mod):
    from transcover.lipschitz import lipschitz_bounds, lipschitz_lower
    from transcover.model._compare import require_same_structure

    model = _llama(transformers_mod)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = _renamed(model, Path(tmp))
        full, windowed = load(path, roles=ROLES), load(path, roles={**ROLES, "window": 3})
        assert structural_differences(full, windowed)[0] == "masking: layer 0 sliding window=None vs 3"
        with pytest.raises(InputError, match="sliding window=None vs 3"):
            require_same_structure(full, windowed)
        spec = windowed.to_torch(torch.float64)
        bounds = lipschitz_bounds(spec, radius=2.0)
        # raises CertificateViolation if any searched lower value exceeds its certified stage bound
        lower = lipschitz_lower(spec, bounds, seq_len=8, n_samples=2, n_steps=15, seed=1, stages=False)
        assert 0 < lower[(-2, "network")].value.value <= bounds.upper.value


def test_g3_on_windowed_models_holds_beyond_the_window(transformers_mod):
    """Lemma G.3 between two windowed models (same window, nearby weights), mapped from live modules:
    the certified bound dominates the measured change on sequences longer than the window."""
    from transcover.lipschitz import perturbation_bound, perturbation_lower

    hf_roles = {**ROLES, "layers": "model.layers.{i}.", "window": 3,
                "roles": {"W_Q": "self_attn.q_proj.weight", "W_K": "self_attn.k_proj.weight",
                          "W_V": "self_attn.v_proj.weight", "W_O": "self_attn.o_proj.weight",
                          "W_gate": "mlp.gate_proj.weight", "W_1": "mlp.up_proj.weight", "W_2": "mlp.down_proj.weight",
                          "norm_attn.weight": "input_layernorm.weight",
                          "norm_ffn.weight": "post_attention_layernorm.weight"},
                "final_norm": {"weight": "model.norm.weight"}, "embeddings": {}}
    a = _llama(transformers_mod).double()
    b = _llama(transformers_mod).double()
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(1e-2 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    spec_a, spec_b = load(a, roles=hf_roles), load(b, roles=hf_roles)
    assert spec_a.layers[1].attention.window == 3
    bound = perturbation_bound(spec_a, spec_b, radius=1.0)
    lower = perturbation_lower(spec_a, spec_b, radius=1.0, seq_len=7, n_samples=2, n_steps=10, seed=3)
    assert 0 < lower.value.value <= bound.total.value


@pytest.mark.parametrize("drop", ["rope_theta", "norm", "activation", "placement", "causal", "eps"])
def test_a_roles_mapping_states_every_field_that_chooses_the_function(transformers_mod, tmp_path, capsys, drop):
    """Red team 175: an omitted rope_theta read a RoPE model without RoPE (B_KQ at offset 0 only), an omitted norm
    read layernorm; nothing is guessed now ("rope_theta": null and "norm": "none" say none)."""
    path = _renamed(_llama(transformers_mod), tmp_path)
    (tmp_path / "roles.json").write_text(json.dumps({k: v for k, v in ROLES.items() if k != drop}))
    assert main(["analyze", str(path), "--roles", str(tmp_path / "roles.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"state '{drop}'" in err[0] and "nothing is guessed" in err[0], err


def test_a_roles_mapping_reads_every_layer_and_its_declared_norms(transformers_mod, tmp_path):
    """Red team 175: (a) only layer 0 was searched for tensors no role names, so a bias in layer 1 and an unnamed
    final norm were ignored even under strict; (b) a declared norm whose tensors the mapping does not name was
    dropped (NormKind.NONE): the non-parametric norm (gain 1) certified 243.9 where that model attains 355."""
    from safetensors.torch import load_file, save_file

    from transcover.model import NormKind

    path = _renamed(_llama(transformers_mod), tmp_path)
    tensors = load_file(path)
    tensors["blk.1.attn.wq.bias"] = torch.full((D,), 100.0)
    save_file(tensors, path)
    with pytest.warns(TranscoverWarning, match=r"unexpected tensor 'blk\.1\.attn\.wq\.bias'"):
        load(path, roles=ROLES)
    with pytest.raises(InputError, match=r"refused \(strict\).*blk\.1\.attn\.wq\.bias"):
        load(path, roles=ROLES, strict=True)
    unnamed_final = {k: v for k, v in ROLES.items() if k != "final_norm"}
    del tensors["blk.1.attn.wq.bias"]
    save_file(tensors, path)
    with pytest.raises(InputError, match=r"refused \(strict\).*'out_norm\.weight'"):
        load(path, roles=unnamed_final, strict=True)
    no_norm_roles = {**ROLES, "roles": {k: v for k, v in ROLES["roles"].items() if not k.startswith("norm_")}}
    for k in [k for k in tensors if ".n1." in k or ".n2." in k]:
        del tensors[k]
    save_file(tensors, path)
    spec = load(path, roles=no_norm_roles)
    norm = spec.layers[0].norm_attn
    assert norm.kind is NormKind.RMSNORM and norm.weight is None and norm.eps == ROLES["eps"]
