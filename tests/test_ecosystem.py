"""The ecosystem as users call it: TRL's SFTTrainer(model="<path>"), and DPOTrainer with its reference model, under a
real `accelerate launch` (ZeRO-3, bf16) train with `import hf_zero3_loader.auto` exactly as without it, and the SFT
run's `save_model` (and accelerate's) write the same files without a gather; LoRA through TRL trains the same under
ZeRO-3 and ZeRO-3 + EP and saves its adapter gathering only it; MoE experts whose forward depends on the routing are
ZeRO-3 leaf modules and train with each rank on its own tokens (a vision-language MoE on its own images too); a PEFT
adapter folder loads its base model and its adapter as the plain load does; GRPO (sampling, rewards, a reference
model) samples and trains the same under ZeRO-3 + EP; a Trainer run under EP resumes from its periodic checkpoints to
the uninterrupted run's losses; the Trainer with Ulysses sequence parallelism (ALST) trains the same.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.checkpoints import add_word_tokenizer, ep_config, make_checkpoint, trainable_moe_config
from tests.conftest import run_torchrun
from tests.dist_worker import NOTHING_PERSISTENT, ds_config_for
from tests.test_accelerate import accelerate_launch


def _trl_runs(workdir: str, name: str, script: str, zero: dict) -> tuple[dict, dict]:
    """`script` under `accelerate launch` (ZeRO-3, bf16) with and without the import: what each run wrote."""
    path = add_word_tokenizer(make_checkpoint(os.path.join(workdir, f"{name}_qwen3_moe"), "qwen3_moe",
                                              config=trainable_moe_config()), 101)
    config = _ds_config_file(workdir, name, False, zero=zero)
    runs = {}
    for variant in ("with-loader", "without"):
        out = os.path.join(workdir, f"{name}_{variant}.json")
        accelerate_launch(config, script, path, out, variant)
        with open(out) as f:
            runs[variant] = json.load(f)
    return runs["with-loader"], runs["without"]


def test_trl_sft_trainer_with_a_model_path_trains_the_same_with_the_import(workdir):
    ours, upstream = _trl_runs(workdir, "trl", "trl_script.py", {"stage3_gather_16bit_weights_on_model_save": True})
    assert ours["report"]["init_context"] == "zero3-meta" and upstream["report"] is None
    assert len(ours["losses"]) == 3
    assert ours["losses"] == upstream["losses"]
    assert ours["param_dtypes"] == upstream["param_dtypes"] == ["torch.bfloat16"]  # TRL asked float32: engine wins
    # saving: Trainer.save_model and Accelerator.save_model write, without a gather, the files the gathered path
    # (stage3_gather_16bit_weights_on_model_save) writes
    for how in ("trainer", "accelerate"):
        mine, theirs = (os.path.join(workdir, f"trl_saved_{v}", how) for v in ("with-loader", "without"))
        names = sorted(os.listdir(theirs))
        assert sorted(os.listdir(mine)) == names, (how, sorted(os.listdir(mine)), names)
        for name in names:
            if name == "training_args.bin":  # pickled arguments: same fields, not the same bytes
                continue
            with open(os.path.join(mine, name), "rb") as a, open(os.path.join(theirs, name), "rb") as b:
                assert a.read() == b.read(), f"{how}: {name} differs"


@pytest.mark.sweep
def test_trl_dpo_trainer_loads_its_reference_model_too_and_trains_the_same_with_the_import(workdir):
    """DPOTrainer(model="<path>") loads the path twice (the policy, then its frozen reference, which TRL wraps in an
    inference ZeRO-3 engine of its own): both loads go through the loader, and the losses and rewards (policy
    against reference log-probabilities) are the plain path's, bit for bit."""
    ours, upstream = _trl_runs(workdir, "dpo", "trl_dpo_script.py", {})
    assert ours["init_contexts"] == ["zero3-meta", "zero3-meta"] and upstream["init_contexts"] == [None, None]
    assert ours["ref_model"] == upstream["ref_model"] == "DeepSpeedEngine"
    assert len(ours["logged"]) == 3 and ours["logged"][-1]["rewards/chosen"] != 0.0
    assert ours["logged"] == upstream["logged"]


def _ep_moe_with_tokenizer(workdir: str) -> str:
    """A Qwen3-MoE whose expert count divides by 2 (for EP), with a word tokenizer: what TRL loads from a path."""
    return add_word_tokenizer(make_checkpoint(os.path.join(workdir, "trl_ep_qwen3_moe"), "qwen3_moe",
                                              config=ep_config("qwen3_moe")), 101)


def _ds_config_file(workdir: str, name: str, expert_parallel: bool, zero: dict | None = None, **ep_fields) -> str:
    """An accelerate user's DeepSpeed config file (ZeRO-3 with `zero`'s options, the Trainer fills in the "auto"s),
    with an `expert_parallel` section (EP size 2) when asked. Every parameter is gathered and released at each step
    (`NOTHING_PERSISTENT`)."""
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "zero_optimization": {**NOTHING_PERSISTENT, **(zero or {})},
          "bf16": {"enabled": "auto"}}
    if expert_parallel:
        ds["expert_parallel"] = {"enabled": True, "autoep_size": 2, "use_grouped_mm": False, **ep_fields}
    config = os.path.join(workdir, f"ds_{name}.json")
    with open(config, "w") as f:
        json.dump(ds, f)
    return config


# ZeRO-3 without EP gives the plain path's numbers too (by hand; nothing there draws differently, see the SFT and DPO
# tests): one case here keeps the suite's time down
@pytest.mark.sweep
@pytest.mark.parametrize("mode", ["expert parallel"])
def test_trl_grpo_on_a_moe_samples_and_trains_the_same_with_the_import(workdir, mode):
    """Reinforcement learning on a MoE (`GRPOTrainer(model=path, reward_funcs=...)`, its reference model loaded a
    second time at `beta` 0.1): completions sampled under ZeRO-3 with the parameters gathered for generation (each
    rank its own prompts, ranks kept in step by transformers' `synced_gpus`), then scored and trained on. Every logged
    number (losses, gradient norms, rewards, completion lengths, KL to the reference, entropy) equals the plain
    path's, under ZeRO-3 and under ZeRO-3 + EP against engine-side AutoEP. Sampling draws from the global RNG after
    `deepspeed.initialize`: engine-side AutoEP draws there for each router it builds, which the loader's layers,
    built at the load, had not; the loader makes the same draws (before that, the EP run sampled other completions
    from the first step)."""
    tag = mode.replace(" ", "_")
    config = _ds_config_file(workdir, f"trl_grpo_{tag}", mode == "expert parallel")
    path = _ep_moe_with_tokenizer(workdir)
    runs = {}
    for variant in ("with-loader", "without"):
        out = os.path.join(workdir, f"trl_grpo_{tag}_{variant}.json")
        accelerate_launch(config, "trl_grpo_script.py", path, out, variant)
        with open(out) as f:
            runs[variant] = json.load(f)
    ours, upstream = runs["with-loader"], runs["without"]
    context = "ep-meta" if mode == "expert parallel" else "zero3-meta"
    assert ours["init_contexts"] == [context, context] and upstream["init_contexts"] == [None, None]
    assert ours["ref_model"] == upstream["ref_model"] == "DeepSpeedEngine"
    layers = ["AutoEPMoELayer"] if mode == "expert parallel" else ["Qwen3MoeSparseMoeBlock"]
    assert ours["moe_layers"] == upstream["moe_layers"] == layers
    assert len(ours["logged"]) == 3 and any(step["kl"] != 0.0 for step in ours["logged"])
    assert ours["logged"] == upstream["logged"]  # gradient norms too (see the next test on the routers' group)


@pytest.mark.sweep
def test_trainer_checkpoints_under_expert_parallelism_resume_to_the_uninterrupted_run(workdir):
    """A long MoE fine-tune under ZeRO-3 + EP takes periodic Trainer checkpoints (`save_strategy="steps"`: DeepSpeed's
    engine checkpoint, and the model, which the import writes without a gather) and is resumed from one: the resumed
    run's losses and gradient norms are the uninterrupted run's, bit for bit, and transformers + engine-side AutoEP's.
    The checkpoints cross the import both ways: one taken under engine-side AutoEP resumes with the import added, and
    one taken with it resumes without it. ZeRO-3 keeps an optimizer sub-group per process group and a checkpoint
    records them (DeepSpeed refuses another layout: "AutoEP ZeRO-3 checkpoints can only be loaded with the same
    parameter placement topology"); the engine partitions the routers AutoEP builds over its data-parallel group, a
    group of their own, and so does the load. The uninterrupted run takes its model through `model_init=`
    (hyperparameter search's form), so a second EP model loaded in the process while the first is alive trains the
    same too."""
    config = _ds_config_file(workdir, "trainer_resume_ep", True)
    path = _ep_moe_with_tokenizer(workdir)
    runs = {}

    def launch(name: str, mode: str, *without: str, folder: str = workdir) -> None:
        os.makedirs(folder, exist_ok=True)  # the run's checkpoints go to <folder>/resume_run_<mode>
        out = os.path.join(folder, f"trainer_resume_{name}.json")
        accelerate_launch(config, "trainer_resume_script.py", path, out, mode, *without)
        with open(out) as f:
            runs[name] = json.load(f)

    for mode in ("full", "first", "resume"):
        launch(mode, mode)
    launch("full_without", "full", "without", folder=os.path.join(workdir, "resume_without"))
    # a checkpoint taken without the import, resumed with it; one taken with it (`first`), resumed without it
    launch("first_without", "first", "without", folder=os.path.join(workdir, "resume_without"))
    launch("resume_with", "resume", folder=os.path.join(workdir, "resume_without"))
    shutil.copytree(os.path.join(workdir, "resume_run_first"), os.path.join(workdir, "resume_ours", "resume_run_first"))
    launch("resume_without", "resume", "without", folder=os.path.join(workdir, "resume_ours"))
    assert len(runs["full"]["losses"]) == 4 and runs["first"]["losses"] == runs["full"]["losses"][:2]
    full = runs["full"]
    for name in ("resume", "full_without", "resume_with", "resume_without"):
        assert (runs[name]["losses"], runs[name]["grad_norms"]) == (full["losses"], full["grad_norms"]), name
    assert runs["resume_with"]["expert_parallel_loads"] == [True]
    assert runs["resume_without"]["expert_parallel_loads"] == [False]
    assert runs["full"]["expert_parallel_loads"] == [True, True] and runs["resume"]["expert_parallel_loads"] == [True]
    first = runs["first"]["checkpoints"]["checkpoint-2"]
    assert {"model.safetensors", "latest", "global_step2", "trainer_state.json"} <= set(first), first


@pytest.mark.sweep
def test_trainer_with_ulysses_sequence_parallelism_trains_the_same_with_the_import(workdir):
    """Long-context fine-tuning (ALST: the Trainer's `parallelism_config` with DeepSpeed Ulysses, each sequence split
    over 2 ranks) on a MoE: DeepSpeed's sequence-parallel engine takes the partitions the loader built, and every
    logged loss and gradient norm is the plain path's, bit for bit."""
    ours, upstream = _trl_runs(workdir, "ulysses", "trainer_sequence_parallel_script.py", {})
    assert ours["report"]["init_context"] == "zero3-meta" and upstream["report"] is None
    assert len(ours["logged"]) == 3 and ours["logged"] == upstream["logged"]


@pytest.mark.sweep
@pytest.mark.parametrize("mode", ["zero3", "expert parallel"])
def test_trl_lora_on_a_moe_trains_the_same_with_the_import_and_saves_its_adapter_gathering_only_it(workdir, mode):
    """LoRA fine-tuning as TRL users write it (`SFTTrainer(model=path, peft_config=LoraConfig(...))`, the output head
    trained whole beside the adapter, then `trainer.save_model`), under ZeRO-3 and under ZeRO-3 with expert
    parallelism. The losses are the plain path's bit for bit (engine-side AutoEP under EP: its config names the MoE
    layers as PEFT's wrapper does, and the same file loads with the loader). The Trainer saves the adapter from
    DeepSpeed's consolidated state dict, which gathers the whole model (ZeRO-3) or is refused for AutoEP layers (EP:
    the run fails at its save); with the import only the adapter's tensors are gathered, and the files are the plain
    path's, byte for byte (ZeRO-3) or the adapter as trained (EP)."""
    from safetensors.torch import load_file

    path = _ep_moe_with_tokenizer(workdir)
    tag = mode.replace(" ", "_")
    config = _ds_config_file(workdir, f"trl_lora_{tag}", mode == "expert parallel",
                             moe_layer_pattern=r"base_model\.model\.model\.layers\.\d+\.mlp")
    runs = {}
    for variant in ("with-loader", "without"):
        out = os.path.join(workdir, f"trl_lora_{tag}_{variant}.pt")
        accelerate_launch(config, "trl_lora_script.py", path, out, variant)
        runs[variant] = {**torch.load(out, weights_only=False), "saved": out + ".saved"}
    ours, upstream = runs["with-loader"], runs["without"]
    assert len(ours["losses"]) == 3 and ours["losses"] == upstream["losses"]
    assert ours["adapter"].keys() == upstream["adapter"].keys() and len(ours["adapter"]) == 9
    assert all(torch.equal(ours["adapter"][n], upstream["adapter"][n]) for n in ours["adapter"])
    layers = ["AutoEPMoELayer"] if mode == "expert parallel" else ["Qwen3MoeSparseMoeBlock"]
    assert ours["moe_layers"] == upstream["moe_layers"] == layers
    assert ours["report"]["init_context"] == ("ep-meta" if mode == "expert parallel" else "zero3-meta")
    # the save: ours gathers the adapter's bytes only, upstream every parameter of the model
    adapter_bytes = sum(t.numel() * t.element_size() for t in ours["adapter"].values())
    model_bytes = os.path.getsize(os.path.join(path, "model.safetensors")) // 2  # fp32 on disk, bf16 in training
    assert ours["save_error"] is None and set(ours["save_collective_bytes"]) == {"deepspeed.all_gather_function"}
    assert ours["save_collective_bytes"]["deepspeed.all_gather_function"] <= 2 * adapter_bytes
    saved = load_file(os.path.join(ours["saved"], "adapter_model.safetensors"))
    as_saved = {n.replace(".modules_to_save.default.", ".").replace(".default.", "."): t
                for n, t in ours["adapter"].items()}
    assert saved.keys() == as_saved.keys() and all(torch.equal(saved[n], t) for n, t in as_saved.items())
    if mode == "expert parallel":
        assert upstream["save_error"].startswith("NotImplementedError") and "AutoEP" in upstream["save_error"]
        return
    assert sum(upstream["save_collective_bytes"].values()) >= model_bytes
    names = sorted(os.listdir(upstream["saved"]))
    assert sorted(os.listdir(ours["saved"])) == names and "adapter_model.safetensors" in names
    for name in names:
        mine, theirs = (Path(run["saved"], name).read_bytes() for run in (ours, upstream))
        if name == "adapter_config.json":  # PEFT writes target_modules from a set: in the process's hash order
            mine, theirs = ({**c, "target_modules": sorted(c["target_modules"])}
                            for c in map(json.loads, (mine, theirs)))
        if name != "training_args.bin":  # pickled arguments: same fields, not the same bytes
            assert mine == theirs, f"{name} differs"


# MoE types whose experts' eager forward runs a submodule once per expert that received tokens, and their experts
# class: fused experts calling `act_fn` (Qwen3-MoE, whose block DeepSpeed's default leaf list holds; DeepSeek-V3, whose
# block it does not), DBRX running its `mlp` per expert
ROUTED_SUBMODULES = {"qwen3_moe": "Qwen3MoeExperts", "deepseek_v3": "DeepseekV3Experts", "dbrx": "DbrxExperts"}


def _modules_run(model: torch.nn.Module, input_ids: torch.Tensor) -> list[str]:
    """The names of the modules whose forward runs, in order (what ZeRO-3 traces), in one forward."""
    names = {id(module): name for name, module in model.named_modules()}
    ran: list[str] = []
    hook = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, _: ran.append(names.get(id(m), "?")))
    try:
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
    finally:
        hook.remove()
    return ran


def _experts_hit(model, seed: int, seq_len: int) -> list[int]:
    """How many experts each MoE layer of the plain model runs for the first batch `train_losses` draws with `seed`."""
    import collections

    ids = torch.randint(0, model.config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(seed))
    runs = collections.Counter(name for name in _modules_run(model, ids)
                               if name.endswith((".experts.act_fn", ".experts.mlp")))
    return list(runs.values())  # in the order the layers ran


def test_experts_whose_forward_depends_on_the_routing_are_leaf_modules_and_train_as_deepspeeds_own_fix_does(workdir):
    """ZeRO-3 checks that every rank traced the same modules. Fused experts gather the same parameters whatever the
    routing, but their eager forward calls `act_fn` once per expert that received tokens (DBRX its `mlp`), so ranks on
    different tokens trace different lengths: DeepSpeed stops with "Detected a disagreement on list length between rank0
    and rank1" (by hand, DeepSeek-V3 and DBRX without the loader; Qwen3-MoE's block is on DeepSpeed's default leaf list,
    and Qwen3-VL-MoE's is not). The load marks the experts modules as ZeRO-3 leaf modules; 3 steps with each rank on its
    own tokens (that route to different numbers of experts) give the losses of transformers' ZeRO-3 load with
    `set_z3_leaf_modules(model, [<experts class>])` applied by hand, bit for bit; the load gives every parameter and
    buffer of plain single-process `from_pretrained`, bit and dtype."""
    import transformers

    from tests.families import small_config

    from tests.test_fidelity import reference

    every_param_gathered = ds_config_for("float32", {"zero_optimization": NOTHING_PERSISTENT})
    cases, paths = [], {}
    for family, experts_class in ROUTED_SUBMODULES.items():
        if family == "dbrx":
            config = small_config("dbrx")
            config.attn_config.clip_qkv = 8.0  # transformers 5.24's DBRX attention fails with clip_qkv None
        else:
            config = ep_config(family)
        path = paths[family] = make_checkpoint(os.path.join(workdir, f"routed_{family}"), family, config=config,
                                               model_class=transformers.AutoModelForCausalLM)
        # a batch length at which the ranks' first batches (dist_worker's per-rank draws) run different numbers of
        # experts: the first step's traces would differ in length
        plain = transformers.AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")
        seq_len = next(n for n in range(2, 13) if _experts_hit(plain, 1234, n) != _experts_hit(plain, 1235, n))
        for variant in ("ours", "plain ZeRO-3 + set_z3_leaf_modules"):
            marked_by_hand = variant != "ours"
            cases.append({"name": f"{family}/{variant}", "path": path, "dtype": "float32", "train_steps": 3,
                          "seq_len": seq_len, "rank_inputs": True, "kwargs": {"experts_implementation": "eager"},
                          "ds_config": every_param_gathered,
                          "upstream": marked_by_hand, "z3_leaf_classes": [experts_class] if marked_by_hand else None,
                          "out": os.path.join(workdir, f"routed_{family}_{variant.split()[0]}.pt")})
    dumps = run_torchrun(2, cases, workdir, timeout=600)
    for family, ours, by_hand in zip(ROUTED_SUBMODULES, dumps[::2], dumps[1::2]):
        for dump in (ours, by_hand):
            assert all("error" not in r for r in dump["ranks"]), (family, dump["rank0"].get("error"))
        marked = ours["rank0"]["report"]["leaf_modules"]
        assert marked and all(name.endswith(".experts") for name in marked), marked
        # the load itself: every parameter and buffer as plain single-process from_pretrained gives it
        plain = reference(paths[family], "float32", "AutoModelForCausalLM")
        assert set(ours["rank0"]["state"]) == set(plain), family
        for name, value in plain.items():
            got = ours["rank0"]["state"][name]
            assert got.dtype == value.dtype and torch.equal(got, value), f"{family} {name}"
        assert [r["losses"] for r in ours["ranks"]] == [r["losses"] for r in by_hand["ranks"]], family
        assert ours["ranks"][0]["losses"] != ours["ranks"][1]["losses"]


def _torchrun_script(script: str, *args: str, timeout: float = 300) -> None:
    """`torchrun --nproc_per_node 2 tests/SCRIPT ARGS`, as a user launches a script."""
    import subprocess
    import sys

    from tests.conftest import ROOT, free_port, python_path

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), os.path.join(ROOT, "tests", script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-6000:]


@pytest.mark.parametrize("family, mode", [pytest.param("qwen3_vl_moe", "zero3", marks=pytest.mark.sweep),
                                          pytest.param("qwen3_vl_moe", "expert parallel", marks=pytest.mark.sweep),
                                          pytest.param("ernie4_5_vl_moe", "zero3", marks=pytest.mark.sweep)])
def test_a_vision_language_moe_trains_on_images_as_upstream_does(workdir, family, mode):
    """A vision-language MoE fine-tuned on images (tests/vlm_training_script.py), 3 steps at 2 ranks, every parameter
    gathered and released at each step: every rank's losses equal transformers' own ZeRO-3 path's, bit for bit.
    - Qwen3-VL-MoE, each rank its own text and images of its own sizes, so the vision tower and the experts see
      different tokens on each rank. Under ZeRO-3 transformers' path stops at the first step without DeepSpeed's
      leaf-module fix (by hand: "Detected a disagreement on list length", the experts' `act_fn` ran 5 times on one
      rank and 6 on the other), so it gets the fix by hand and the load marks the experts itself. Under EP it is
      engine-side AutoEP (on the checkpoint rewritten in the model's layout: transformers' own ZeRO-3 load does not
      apply the conversion ops), and nothing is marked (the AutoEP layers replaced the experts).
    - Ernie 4.5 VL MoE, images on rank 0, text only on rank 1 (with the usual dummy vision pass): each MoE layer runs
      its vision MoE block only on rank 0, and marking the experts is not enough (by hand, transformers' path with its
      `Ernie4_5_VLMoeSparseMoeBlock` marked: gloo's "Received data size doesn't match expected size"). The load marks
      the layer's `mlp`, which holds the text and vision blocks; transformers' path gets the same mark by hand."""
    from transformers import AutoModelForImageTextToText

    from tests.checkpoints import ernie4_5_vl_moe_config, rewrite_checkpoint, transpose_experts
    from tests.test_expert_parallel import checkpoint

    if family == "qwen3_vl_moe":
        path = checkpoint(workdir, family)
        engine_side = rewrite_checkpoint(path, path + "_model_layout", transpose_experts)
    else:  # the quantized tests' checkpoint (tests/test_quantized.py)
        path = engine_side = make_checkpoint(os.path.join(workdir, "quant", "ernie_vl"), "e",
                                             config=ernie4_5_vl_moe_config(), model_class=AutoModelForImageTextToText)
    ep_size = "2" if mode == "expert parallel" else "0"
    runs = {}
    for variant, folder in (("ours", path), ("without", engine_side)):
        out = os.path.join(workdir, f"vlm_training_{family}_{mode.replace(' ', '_')}_{variant}.json")
        _torchrun_script("vlm_training_script.py", folder, out, variant, ep_size, family)
        with open(out) as f:
            runs[variant] = json.load(f)
    assert runs["ours"]["losses"] == runs["without"]["losses"]
    assert runs["ours"]["losses"][0] != runs["ours"]["losses"][1]  # the ranks trained on different inputs
    marked = runs["ours"]["leaf_modules"]
    if mode == "expert parallel":
        assert marked == []
    elif family == "ernie4_5_vl_moe":  # its first layer is dense
        assert marked == ["model.language_model.layers.1.mlp"]
    else:
        assert marked == [f"model.language_model.layers.{i}.mlp.experts" for i in range(2)]


# seq2seq MoE types whose experts are still one module each (a ModuleDict), and that container's class
PER_EXPERT_MOE = {"switch_transformers": "SwitchTransformersExperts", "nllb-moe": "NllbMoeExperts"}


@pytest.mark.sweep
def test_per_expert_moe_blocks_are_leaf_modules_and_train_as_deepspeeds_own_fix_does(workdir):
    """Switch Transformers and NLLB-MoE keep each expert its own module, run only for the tokens routed to it: with
    each rank on its own tokens, ZeRO-3's all-gathers no longer pair up (Switch Transformers, by hand: gloo's "Received
    data size doesn't match expected size", without the loader too). The load marks each experts container as a
    ZeRO-3 leaf module; 3 training steps then give the losses of the plain ZeRO-3 load with DeepSpeed's own fix applied
    by hand (`set_z3_leaf_modules(model, [<experts class>])`), bit for bit, on both ranks."""
    import transformers

    from tests.families import small_head_config

    cases = []
    for family, experts_class in PER_EXPERT_MOE.items():
        config = small_head_config(family, "AutoModelForSeq2SeqLM")
        config.update({"decoder_start_token_id": 0, "pad_token_id": 0, "encoder_sparse_step": 1,
                       "decoder_sparse_step": 1})
        for key in ("dropout_rate", "router_jitter_noise", "dropout", "attention_dropout", "activation_dropout",
                    "moe_token_dropout", "encoder_layerdrop", "decoder_layerdrop"):
            if hasattr(config, key):  # no randomness in the steps (the two loads draw differently before them; a
                setattr(config, key, 0.0)  # layer dropped on one rank only would pair no all-gather)
        path = make_checkpoint(os.path.join(workdir, f"per_expert_{family}"), family, config=config,
                               model_class=transformers.AutoModelForSeq2SeqLM)
        for variant in ("ours", "plain ZeRO-3 + set_z3_leaf_modules"):
            marked_by_hand = variant != "ours"
            cases.append({"name": f"{family}/{variant}", "path": path, "dtype": "float32", "train_steps": 3,
                          "seq_len": 1, "rank_inputs": True, "model_class": "AutoModelForSeq2SeqLM",
                          "upstream": marked_by_hand, "z3_leaf_classes": [experts_class] if marked_by_hand else None,
                          "out": os.path.join(workdir, f"per_expert_{family}_{variant.split()[0]}.pt")})
    dumps = run_torchrun(2, cases, workdir, timeout=600)
    for family, ours, by_hand in zip(PER_EXPERT_MOE, dumps[::2], dumps[1::2]):
        for dump in (ours, by_hand):
            assert all("error" not in r for r in dump["ranks"]), family
        marked = ours["rank0"]["report"]["leaf_modules"]
        assert marked and all(name.endswith(".experts") for name in marked), marked
        assert [r["losses"] for r in ours["ranks"]] == [r["losses"] for r in by_hand["ranks"]], family
        assert ours["ranks"][0]["losses"] != ours["ranks"][1]["losses"]


@pytest.mark.sweep
def test_every_moe_family_fuses_its_experts_into_one_module():
    import torch
    from transformers import AutoModelForCausalLM

    from tests.families import SWEEP, small_config

    for family in SWEEP:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(small_config(family))
        for name, module in model.named_modules():
            if name.endswith("experts"):
                assert not isinstance(module, torch.nn.ModuleList), f"{family}: {name} is a per-expert ModuleList"


@pytest.mark.sweep
def test_leaf_modules_are_the_experts_modules_whose_forward_runs_them():
    """Over the family sweep (built on the meta device): every experts module the parent's forward runs and whose
    forward calls a submodule is marked (fused experts and their `act_fn`, DBRX's per-expert `mlp`); shared experts
    are not (they run for every token), nor JetMoE's attention experts, which its attention runs through other
    methods (a leaf module whose forward never runs would never be gathered). A module holding a text and a vision MoE
    block is marked whole (Ernie 4.5 VL MoE)."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

    from hf_zero3_loader.leaf_modules import experts_to_mark
    from tests.checkpoints import ernie4_5_vl_moe_config
    from tests.families import SWEEP, small_config, small_head_config

    marked_families = set()
    for family in SWEEP:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(small_config(family))
        marked = experts_to_mark(model)
        assert not any("shared" in name for name in marked), (family, marked)
        for name, module in model.named_modules():
            if name.endswith(".experts") and isinstance(getattr(module, "act_fn", None), torch.nn.Module):
                assert name in marked, (family, name)
        if marked:
            marked_families.add(family)
            assert all(name.endswith(".experts") for name in marked), (family, marked)
        if family == "jetmoe":
            assert not any("self_attention" in name for name in marked), marked
    assert {"qwen3_moe", "deepseek_v3", "mixtral", "dbrx", "qwen3_5_moe"} <= marked_families
    assert not marked_families & {"llama", "gpt_oss", "jetmoe"}  # GPT-OSS's experts call no submodule
    # Muse Spark's experts run a norm (a parameter of its own) after each expert that received tokens: marked, as
    # the parent's forward calls them (by hand: transformers' ZeRO-3 path stops at the first step without the mark)
    with torch.device("meta"):
        model = AutoModel.from_config(small_head_config("muse_spark_text", "AutoModel"))
    assert experts_to_mark(model) == ["layers.0.mlp.experts", "layers.1.mlp.experts"]
    # Ernie 4.5 VL MoE's layer runs its vision MoE block only for batches with image tokens: the layer's `mlp`, which
    # holds the text and vision blocks, is marked in place of their experts (the only such type over the head sweep)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(ernie4_5_vl_moe_config())
    assert experts_to_mark(model) == ["model.language_model.layers.1.mlp"]


@pytest.mark.sweep
def test_outside_the_leaf_modules_every_moe_type_runs_the_same_modules_whatever_the_tokens():
    """What the marks are for, checked on the forward itself: every MoE type of the family sweep, built small with
    eager experts and run on 8 short inputs (2 tokens route to between k and 2k experts), runs the same modules in the
    same order outside the marked leaf modules, whatever the tokens, in training and in eval mode. Without the marks
    the same runs differ in most of these types (the check sees what it is for)."""
    from transformers import AutoModelForCausalLM

    from hf_zero3_loader.leaf_modules import experts_to_mark
    from tests.families import SWEEP, small_config

    differ_unmarked = []
    moe_types = 0
    for family in SWEEP:
        config = small_config(family)
        if getattr(config, "qk_rope_head_dim", None):  # the sweep's MLA sizes load but do not run: make them run
            config.head_dim, config.num_key_value_heads = config.qk_rope_head_dim, config.num_attention_heads
        if family == "dbrx":
            config.attn_config.clip_qkv = 8.0
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, experts_implementation="eager")
        if not any("expert" in name for name, _ in model.named_modules()):
            continue
        moe_types += 1
        marked = experts_to_mark(model)
        vocab = config.get_text_config().vocab_size
        inputs = [torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))
                  for seed, n in [(s, 2) for s in range(6)] + [(6, 5), (7, 12)]]
        for training in (False, True):
            model.train(training)
            runs = [_modules_run(model, ids) for ids in inputs]
            outside = [[n for n in run if not any(n == m or n.startswith(m + ".") for m in marked)] for run in runs]
            assert all(o == outside[0] for o in outside), (family, training, marked)
            if not training and any(run != runs[0] for run in runs):
                differ_unmarked.append(family)
    assert moe_types >= 50 and len(differ_unmarked) >= 40, (moe_types, differ_unmarked)
    assert {"qwen3_moe", "mixtral", "dbrx", "qwen3_5_moe", "glm4_moe", "minimax_m2"} <= set(differ_unmarked)


@pytest.mark.parametrize("lora", [False, pytest.param(True, marks=pytest.mark.sweep)], ids=["full", "lora"])
def test_finetune_script_runs_with_the_expert_parallel_accelerate_config(workdir, lora):
    """scripts/finetune_moe.py as the README shows it, with its defaults, under the shipped ZeRO-3 + EP accelerate
    config, training the whole model or a LoRA adapter (with gradient checkpointing, as LoRA runs often are), then
    saving it. The loss falls visibly (from about 9 to below 1, LoRA to about 3), as a first-time user must see it do.
    (By hand, with gradient checkpointing: a full fine-tune under EP logs engine-side AutoEP's losses, and full or LoRA
    under ZeRO-3 the plain path's.)"""
    import re

    import subprocess
    import sys

    from tests.conftest import ROOT, free_port, python_path

    model = add_word_tokenizer(make_checkpoint(os.path.join(workdir, "trl_qwen3_moe"), "qwen3_moe",
                                               config=trainable_moe_config()), 101)
    out = os.path.join(workdir, f"finetune_run_{'lora' if lora else 'full'}")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "scripts/accelerate/zero3_ep.yaml",
           "--main_process_port", str(free_port()), "scripts/finetune_moe.py", "--model", model,
           "--output-dir", out, *(["--lora", "--gradient-checkpointing"] if lora else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    said = re.search(r"finetune_moe: 40 steps at lr \S+, loss ([\d.]+) at the first step, ([\d.]+) at the last; "
                     r"loaded into ZeRO-3 partitions, expert parallel \(ep_size 2", proc.stdout)
    assert said, proc.stdout[-2000:]
    first, last = float(said[1]), float(said[2])
    assert last < first / 2, (first, last)  # full: about 9 -> 0.4, LoRA: about 9 -> 2.8
    # nothing of DeepSpeed's or transformers' deprecations in a run of the shipped example
    assert "FutureWarning" not in proc.stderr, proc.stderr[-4000:]
    saved = {"adapter_model.safetensors", "adapter_config.json"} if lora else {"model.safetensors", "config.json"}
    assert saved <= set(os.listdir(out)), os.listdir(out)


def _lora_adapter(workdir: str, family: str, modules_to_save: list[str] | None = None) -> str:
    """A PEFT LoRA adapter folder (adapter_config.json naming its base checkpoint, adapter_model.safetensors), with
    non-zero LoRA weights, and modules saved whole changed from the base, so that a missed or misplaced load shows."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = make_checkpoint(os.path.join(workdir, f"lora_base_{family}"), family, sharded=True)
    folder = os.path.join(workdir, f"lora_{family}")
    if not os.path.exists(os.path.join(folder, "adapter_config.json")):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=modules_to_save,
                            init_lora_weights=False)
        peft_model = get_peft_model(model, config)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if ".modules_to_save." in name:
                    param.add_(1.0)
        peft_model.save_pretrained(folder)
    return folder


def test_a_peft_adapter_folder_loads_base_and_adapter_as_the_plain_load(workdir):
    """`from_pretrained("<adapter folder>")`: transformers loads the base model (ours, into ZeRO-3 partitions), then
    PEFT adds the LoRA parameters (and a copy of each module saved whole) and `load_adapter` fills them through a
    second loading call, which must leave the base as loaded (it once re-planned the whole model from the adapter's
    file: every base weight silently zero). Every gathered parameter equals the plain load's, as under transformers'
    own ZeRO-3 path. (The adapter loads for inference, every parameter frozen: nothing to train here.)"""
    import torch
    from transformers import AutoModelForCausalLM

    cases = []
    for family, modules_to_save in (("llama_untied", ["lm_head"]), ("qwen3_moe", None)):
        folder = _lora_adapter(workdir, family, modules_to_save)
        cases += [{"name": f"{family}/{variant}", "path": folder, "dtype": "bfloat16", "upstream": variant == "upstream",
                   "out": os.path.join(workdir, f"lora_{family}_{variant}.pt")} for variant in ("ours", "upstream")]
    dumps = run_torchrun(2, cases, workdir)
    for case, dump in zip(cases, dumps):
        assert "error" not in dump["rank0"], f"{case['name']}: {dump['rank0'].get('error', {}).get('traceback')}"
        plain = AutoModelForCausalLM.from_pretrained(case["path"], dtype=torch.bfloat16)
        want = {n: t.detach() for n, t in [*plain.named_parameters(), *plain.named_buffers()]}
        got = dump["rank0"]["state"]
        assert sum("lora_" in n for n in want) == 8 and set(want) <= set(got), case["name"]
        assert any(".modules_to_save." in n for n in want) == (case["name"].startswith("llama")), case["name"]
        for name, value in want.items():
            assert got[name].dtype == value.dtype and torch.equal(got[name], value), f"{case['name']} {name}"


def test_transformers_zero3_aware_methods_work_after_a_load_given_its_config_directly(workdir):
    """`ds_config=` leaves transformers no `HfDeepSpeedConfig` to ask, so `is_deepspeed_zero3_enabled()` said False
    after our load: `resize_token_embeddings` failed on the partitioned weight (adding tokens, as TRL's chat set-up
    does), and `generate` left `synced_gpus` off, so a rank that finished first stopped joining the gathers and its
    peer hung. The model now keeps one alive. Resizing (tied and untied), training and a generation of a different
    length on each rank (every parameter gathered: no persistent ones) equal transformers' own ZeRO-3 path."""
    config = ds_config_for("float32", {"zero_optimization": NOTHING_PERSISTENT})
    cases = []
    for family in ("llama_untied", "llama_tied"):
        path = make_checkpoint(os.path.join(workdir, family), family)
        cases += [{"name": f"{family}/{variant}", "path": path, "dtype": "float32", "upstream": variant == "upstream",
                   "ds_config": config, "seed": 3, "resize_to": 117, "train_steps": 2, "generate": True,
                   "out": os.path.join(workdir, f"resize_{family}_{variant}.pt")} for variant in ("ours", "upstream")]
    dumps = dict(zip((c["name"] for c in cases), run_torchrun(2, cases, workdir, timeout=600)))
    for family in ("llama_untied", "llama_tied"):
        ours, upstream = dumps[f"{family}/ours"], dumps[f"{family}/upstream"]
        for dump in (ours, upstream):
            assert all("error" not in r for r in dump["ranks"]), [r.get("error") for r in dump["ranks"]]
        assert [r["zero3_visible"] for r in ours["ranks"]] == [True, True]
        got, want = ours["rank0"]["state"], upstream["rank0"]["state"]
        assert set(got) == set(want) and got["model.embed_tokens.weight"].shape[0] == 117
        for name, tensor in want.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), f"{family} {name}"
        assert ours["rank0"]["losses"] == upstream["rank0"]["losses"]
        generated = [r["generated"] for r in ours["ranks"]]
        assert generated == [r["generated"] for r in upstream["ranks"]]
        assert [len(g[0]) for g in generated] == [3 + 2, 3 + 5]


def test_a_model_with_a_0_dim_parameter_trains_under_zero3(workdir):
    """CLIP's `logit_scale` is a 0-dim parameter (transformers' own ZeRO-3 path cannot build the model at all): loaded
    at 2 ranks, one data-parallel step gives the plain model's loss and, for every parameter, its gradient of the mean
    of both ranks' losses."""
    from tests.families import head_checkpoint

    path, out = head_checkpoint(workdir, "AutoModel", "clip"), os.path.join(workdir, "contrastive.json")
    _torchrun_script("contrastive_script.py", path, out, timeout=600)
    with open(out) as f:
        result = json.load(f)
    assert result["scalar_params"] == ["logit_scale"]
    assert result["loss"] == result["plain_loss"]
    worst = max(result["grad_relative_differences"].items(), key=lambda item: item[1])
    assert worst[1] < 1e-4, worst  # summation order differs (two ranks' gradients averaged by a reduce-scatter)
