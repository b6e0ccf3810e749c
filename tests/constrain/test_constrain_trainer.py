"""Issue 10, defect 10: the HF callback under a real ``transformers.Trainer`` (tiny random models, CPU).

(i) optimiser step k of N runs at the schedule's value for progress k / (N - 1), so the last step is at
the target exactly, and the final weights are certified (transcover.norms) within it;
(ii) ``trainer.save_model()`` writes plain weights that ``from_pretrained`` reloads to the same function
(no ``parametrizations`` keys, nothing newly initialised).
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transcover.constrain import ConstraintConfig, TrainingMonitor, constrain, find_slots, hf_callback  # noqa: E402
from transcover.constrain._measure import certified_slot_norm, forward_weights  # noqa: E402

N_STEPS = 6
TARGET = 0.05


class _Data(torch.utils.data.Dataset):
    def __init__(self, n=16, seq=6, vocab=40, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, vocab, (n, seq), generator=g)
        self.labels = (self.ids.sum(1) % 2).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.labels[i]}


def _model(kind):
    torch.manual_seed(0)
    if kind == "bert":
        cfg = transformers.BertConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=2, intermediate_size=32,
                                      vocab_size=40, max_position_embeddings=16, num_labels=2,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return transformers.BertForSequenceClassification(cfg)
    cfg = transformers.GPT2Config(n_embd=16, n_head=2, n_layer=2, vocab_size=40, n_positions=16, num_labels=2,
                                  pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2ForSequenceClassification(cfg)


class _Spy(transformers.TrainerCallback):
    """Runs after transcover's callback: records the radius each step ran at and the certified norms."""

    def __init__(self, cons):
        self.cons, self.progress, self.radii, self.certified = cons, [], [], []

    def on_step_end(self, args, state, control, **kwargs):
        self.progress.append(self.cons.progress)
        self.radii.append(self.cons.radii())
        with forward_weights(self.cons.model):
            self.certified.append({s.key: certified_slot_norm(s) for s in self.cons.slots})


def _train(tmp_path, kind, method):
    model = _model(kind)
    cons = constrain(model, ConstraintConfig(method=method, radii={"all": TARGET}, schedule="linear",
                                             loose_factor=3.0))
    spy = _Spy(cons)
    monitor = TrainingMonitor(model)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=N_STEPS, per_device_train_batch_size=4, learning_rate=5e-2,
        report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Data(),
                                   callbacks=[hf_callback(cons, monitor), spy])
    trainer.train()
    return model, cons, spy, monitor, trainer


def test_radius_per_step_and_target_reached_at_the_end(tmp_path):
    model, cons, spy, monitor, _ = _train(tmp_path, "bert", "project")
    assert spy.progress == [k / (N_STEPS - 1) for k in range(N_STEPS)]
    for k, radii in enumerate(spy.radii):
        expected = cons.schedules["W1.0"](k / (N_STEPS - 1))
        assert all(r == pytest.approx(expected, rel=1e-15) for r in radii.values())
        # the projection after step k used that step's radius: certified within it
        assert max(c / radii[key] for key, c in spy.certified[k].items()) <= 1.0
    assert all(r == TARGET for r in spy.radii[-1].values())  # the last step is at the target exactly
    with forward_weights(model):
        assert max(certified_slot_norm(s) for s in find_slots(model)) <= TARGET
    assert [r["step"] for r in monitor.records] == list(range(1, N_STEPS + 1))
    # the last step's forward ran on the weights the step before projected, at that step's radius (stop 38: the
    # monitor divides by the radius in force); after finalize the weights hold the target
    assert monitor.records[-1]["radius.W1"] == pytest.approx(cons.schedules["W1.0"]((N_STEPS - 2) / (N_STEPS - 1)))
    assert all(r == TARGET for r in cons.radii_in_force().values())


def test_the_first_step_runs_on_projected_weights(tmp_path):
    """Red team 207: ``project`` acts after each step, so the first step's forward and gradient used the
    unprojected initialisation; ``on_train_begin`` of a fresh run now projects, as ``transcover.train`` does."""
    _, cons, _, monitor, _ = _train(tmp_path, "bert", "project")
    first = monitor.records[0]
    assert first["step"] == 1 and first["radius.W1"] == cons.schedules["W1.0"](0.0)
    ratios = {k: v for k, v in first.items() if k.startswith("ratio.") and v is not None}
    assert ratios and max(ratios.values()) <= 1 + 1e-6, ratios


@pytest.fixture(scope="module")
def spectral_runs(tmp_path_factory):
    """One spectral Trainer run per architecture, shared by the saving tests (they do not train)."""
    return {kind: _train(tmp_path_factory.mktemp(kind), kind, "spectral") for kind in ("bert", "gpt2")}


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_save_model_reloads_to_the_same_function(tmp_path, kind, spectral_runs):
    model, cons, _, _, trainer = spectral_runs[kind]
    with forward_weights(model):  # on_train_end finalized: the spectral caps hold, certified
        assert max(certified_slot_norm(s) for s in find_slots(model)) <= TARGET
    out = tmp_path / "saved"
    trainer.save_model(str(out))
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        keys = list(fh.keys())
    assert keys and not any("parametrizations" in k for k in keys)
    reloaded, info = type(model).from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = _Data(n=5, seed=1).ids
    model.eval()
    reloaded.eval()
    with torch.no_grad():
        y, y2 = model(input_ids=ids).logits, reloaded(input_ids=ids).logits
    assert float((y - y2).abs().max()) <= 8 * torch.finfo(torch.float32).eps * max(1.0, float(y.abs().max()))
    assert len(find_slots(model)) and cons.config.method == "spectral"  # the trained model keeps its caps


def test_checkpoint_resume_loads_plain_weights(tmp_path, spectral_runs):
    """Trainer checkpoints are plain too; loading one into the constrained model restores the function."""
    model, cons, _, _, trainer = spectral_runs["bert"]
    trainer.save_model(str(tmp_path / "ckpt"))
    twin = _model("bert")
    constrain(twin, ConstraintConfig(method="spectral", radii={"all": TARGET}))
    from safetensors.torch import load_file

    from transcover.constrain import save_plain

    save_plain(twin)
    state = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    result = twin.load_state_dict(state, strict=False)
    assert not [k for k in result.missing_keys if k.endswith("original")]
    ids = _Data(n=4, seed=2).ids
    model.eval()
    twin.eval()
    with torch.no_grad():
        assert float((model(input_ids=ids).logits - twin(input_ids=ids).logits).abs().max()) <= 1e-6


@pytest.mark.parametrize("max_grad_norm", [1e-3, 0.0])
def test_gradient_norm_is_the_one_before_clipping(tmp_path, max_grad_norm):
    """Stop 38 red team: the Trainer clips before ``on_pre_optimizer_step``, so the per-step ``grad_norm`` read there
    was the clipped norm (every value above max_grad_norm recorded as max_grad_norm).  With clipping on, the column
    now comes from the Trainer's own (pre-clip) logs; without it, from the step."""
    model = _model("bert")
    monitor = TrainingMonitor(model)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=3, per_device_train_batch_size=4, learning_rate=5e-2,
        report_to=[], save_strategy="no", logging_strategy="steps", logging_steps=1, use_cpu=True,
        disable_tqdm=True, seed=0, max_grad_norm=max_grad_norm)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Data(),
                                   callbacks=[hf_callback(None, monitor)])
    trainer.train()
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    values = [r["grad_norm"] for r in monitor.records if r.get("grad_norm") is not None]
    assert len(logged) == 3 and all(g > 1e-2 for g in logged)  # far above the clip: clipping was active
    if max_grad_norm:
        assert values == pytest.approx(logged, rel=1e-6)  # the logged rows, never the clipped 1e-3
    else:
        assert len(values) == 6 and values[0::2] == pytest.approx(logged, rel=1e-5)  # step rows + logged rows


class _PenaltyTrainer(transformers.Trainer):
    """A user's Trainer adding the soft penalty to the loss (a callback cannot change the loss)."""

    def __init__(self, *a, cons=None, **kw):
        super().__init__(*a, **kw)
        self.cons = cons

    def compute_loss(self, model, inputs, return_outputs=False, **kw):
        loss = super().compute_loss(model, inputs, return_outputs=return_outputs, **kw)
        if return_outputs:
            return loss[0] + self.cons.penalty(), loss[1]
        return loss + self.cons.penalty()


def _resumable(out, steps, resume=None, save_steps=2, lr=5e-2, method="spectral"):
    model = _model("bert")
    cons = constrain(model, ConstraintConfig(method=method, radii={"all": TARGET}, schedule="linear",
                                             loose_factor=3.0, penalty_weight=1.0))
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=4, learning_rate=lr, report_to=[],
        save_strategy="steps", save_steps=save_steps, logging_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
        data_seed=0, lr_scheduler_type="constant")
    extra = {"cons": cons} if method == "penalty" else {}
    cls = _PenaltyTrainer if method == "penalty" else transformers.Trainer
    trainer = cls(model=model, args=args, train_dataset=_Data(), callbacks=[hf_callback(cons)], **extra)
    trainer.train(resume_from_checkpoint=resume)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_trainer_resume_of_a_spectral_run_is_the_uninterrupted_run(tmp_path):
    """Note [exact trainer resume]: a plain checkpoint lost the unconstrained tensors and the power iteration, so a
    resumed spectral run went on from other parameters (stop 39 red team: 0.24 max weight difference); the
    constrained state saved beside the weights makes the resumed run the uninterrupted one, bit for bit."""
    import shutil
    import warnings

    from transcover import TranscoverWarning
    from transcover.constrain._export import RAW_STATE_FILE  # the name is the contract: checkpoints carry it

    whole = _resumable(tmp_path / "a", N_STEPS)
    assert (tmp_path / "a" / "checkpoint-2" / RAW_STATE_FILE).is_file()
    shutil.copytree(tmp_path / "a" / "checkpoint-2", tmp_path / "b" / "checkpoint-2")
    resumed = _resumable(tmp_path / "b", N_STEPS, resume=str(tmp_path / "b" / "checkpoint-2"))
    assert whole.keys() == resumed.keys()
    assert [k for k in whole if not torch.equal(whole[k], resumed[k])] == []
    # another run's checkpoint of the same step in output_dir is never read: the state of the folder resumed is
    # found (the red team's run C silently replaced A's weights, 0.758 off), and a file is used only for the weights
    # it was saved with
    _resumable(tmp_path / "c", 2, lr=1e-1)
    beside = _resumable(tmp_path / "c", N_STEPS, resume=str(tmp_path / "a" / "checkpoint-2"), save_steps=100)
    assert [k for k in whole if not torch.equal(whole[k], beside[k])] == []
    # without the file the run is not exact, and says so
    (tmp_path / "b" / "checkpoint-2" / RAW_STATE_FILE).unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _resumable(tmp_path / "b", N_STEPS, resume=str(tmp_path / "b" / "checkpoint-2"), save_steps=100)
    assert any(issubclass(w.category, TranscoverWarning) and RAW_STATE_FILE in str(w.message) for w in caught)


@pytest.mark.parametrize("method", ["penalty", "project"])
def test_trainer_resume_of_penalty_and_project_runs_is_exact_and_quiet(tmp_path, method):
    """A penalty's power iteration lives in its tracker, outside the model: it travels in the state file now (the
    red team measured 0.137 off); project keeps no state beyond the plain weights, and its resume no longer warns
    that it is inexact."""
    import shutil
    import warnings

    whole = _resumable(tmp_path / "a", N_STEPS, method=method)
    shutil.copytree(tmp_path / "a" / "checkpoint-2", tmp_path / "b" / "checkpoint-2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not the uninterrupted one"
        resumed = _resumable(tmp_path / "b", N_STEPS, resume=str(tmp_path / "b" / "checkpoint-2"), method=method)
    assert [k for k in whole if not torch.equal(whole[k], resumed[k])] == []


def test_the_state_file_belongs_to_one_checkpoint_and_a_damaged_one_is_refused(tmp_path):
    """The digest covers every tensor of the plain checkpoint (the red team's frozen encoder: another run's file,
    equal in its constrained tensors, replaced the head); a file whose originals no longer export to the saved
    weights is refused, and the model is left as it was."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from transcover import InputError
    from transcover.constrain import export_plain, load_raw_state, save_plain, save_raw_state

    def resumed(plain_state):  # a fresh constrained model after the Trainer loaded a plain checkpoint into it
        m = _model("bert")
        constrain(m, ConstraintConfig(method="spectral", radii={"all": TARGET}))
        save_plain(m)
        m.load_state_dict(plain_state, strict=False)
        return m

    model = _model("bert")
    constrain(model, ConstraintConfig(method="spectral", radii={"all": TARGET}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # a trained state: originals beyond the caps
    plain = {k: v.clone() for k, v in export_plain(model).state_dict().items()}
    save_raw_state(model, tmp_path)
    good = resumed(plain)
    assert load_raw_state(good, tmp_path) is True
    assert all(torch.equal(model.state_dict()[k], v) for k, v in good.state_dict().items())
    other = {**plain, "classifier.weight": plain["classifier.weight"] + 1.0}  # another checkpoint, same caps' tensors
    assert load_raw_state(resumed(other), tmp_path) is False
    path = tmp_path / "transcover_constrained.safetensors"
    state = load_file(str(path))
    with safe_open(str(path), "pt") as fh:
        meta = fh.metadata()
    key = next(k for k in state if k.endswith("query.parametrizations.weight.original"))
    state[key] = state[key].clone()
    state[key][0, 0] += 0.5  # damaged after it was written
    save_file(state, str(path), metadata=meta)
    victim = resumed(plain)
    before = {k: v.clone() for k, v in victim.state_dict().items()}
    with pytest.raises(InputError, match="is damaged"):
        load_raw_state(victim, tmp_path)
    assert all(torch.equal(before[k], v) for k, v in victim.state_dict().items())


def test_a_logged_loss_row_does_not_give_its_step_a_second_sigma(tmp_path):
    """Red team 171: ``on_log`` repeated the step's number with the weights measured after the step's projection,
    beside the step row measured on the forward's weights: one step, two sigmas. A loss row now carries no norms;
    an evaluation row carries the weights it ran on."""
    model = _model("bert")
    cons = constrain(model, ConstraintConfig(method="project", radii={"all": TARGET}, schedule="linear",
                                             loose_factor=3.0))
    monitor = TrainingMonitor(model)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=3, per_device_train_batch_size=4, learning_rate=5e-2,
        report_to=[], save_strategy="no", logging_strategy="steps", logging_steps=1, use_cpu=True,
        disable_tqdm=True, seed=0)
    transformers.Trainer(model=model, args=args, train_dataset=_Data(), callbacks=[hf_callback(cons, monitor)]).train()
    by_step: dict[int, set] = {}
    for r in monitor.records:
        if r.get("sigma.W1") is not None:
            by_step.setdefault(r["step"], set()).add(r["sigma.W1"])
    assert sorted(by_step) == [1, 2, 3] and all(len(v) == 1 for v in by_step.values()), by_step
    loss_rows = [r for r in monitor.records if r.get("loss") is not None]
    assert len(loss_rows) == 3 and all(r["sigma.W1"] is None for r in loss_rows)
