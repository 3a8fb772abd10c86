"""Find the DeepSpeed config in force, decide the init context from it, and this rank's device.

Order: an explicit `ds_config` (dict or JSON path) -> transformers' `HfDeepSpeedConfig` weakref ->
accelerate's `AcceleratorState` -> the environment `accelerate launch` sets.
"""

from __future__ import annotations

import base64
import binascii
import copy
import functools
import json
import os
from dataclasses import dataclass

import torch

from ._deepspeed_private import arch_list_the_op_builder_cannot_parse
from ._transformers_private import accelerate_shared_state
from .errors import ConfigError


@dataclass
class DeepSpeedSetup:
    config: dict
    found_via: str
    # False where accelerate was told not to build models under `deepspeed.zero.Init` (`zero3_init_flag: false`)
    # and transformers was not given the config either: its `from_pretrained` loads the whole model on every rank,
    # and `deepspeed.initialize` partitions it
    zero_init: bool = True

    @property
    def stage(self) -> int:
        stage = (self.config.get("zero_optimization") or {}).get("stage", 0) or 0
        if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r} ({self.found_via})")
        return stage

    @property
    def partitions_at_load(self) -> bool:
        """ZeRO-3 with `zero.Init` on: the model is built and loaded partitioned (else transformers loads it whole)."""
        return self.stage == 3 and self.zero_init

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype DeepSpeed trains in; None when the config leaves it to 'auto'."""
        for key, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp16", torch.float16)):
            enabled = (self.config.get(key) or {}).get("enabled", False)
            if enabled == "auto":
                return None
            if enabled:
                return dtype
        return torch.float32

    def fields_ranks_share(self) -> dict:
        """The config's fields that decide where and how each rank's partitions are built: ranks given different
        values (one rank's config file edited, a per-node config) must fail together, not load apart."""
        zero = self.config.get("zero_optimization") or {}
        offload = zero.get("offload_param") or {}
        return {"DeepSpeed ZeRO stage": self.stage, "DeepSpeed dtype": str(self.dtype),
                "DeepSpeed offload_param device": str(offload.get("device", "none")).lower(),
                "DeepSpeed offload_param pin_memory": bool(offload.get("pin_memory", False)),
                "DeepSpeed zero_hpz_partition_size": zero.get("zero_hpz_partition_size", 1)}


def _load_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read DeepSpeed config {path}: {e}") from e


def accelerate_config_file(value: str) -> dict:
    """The DeepSpeed config an `accelerate launch` names (`deepspeed_config_file`, ACCELERATE_DEEPSPEED_CONFIG_FILE),
    read as accelerate's `HfDeepSpeedConfig` reads it: a file, else the config itself as JSON text (what the
    shipped scripts/accelerate/*.yaml hold, so that they work from any folder), else as base64-encoded JSON. A
    relative file path is opened from the working directory, as accelerate does: one not found there is named with
    that folder (accelerate says only "Expected a string path to an existing deepspeed config")."""
    if os.path.exists(value):
        return _load_json(value)
    for decode in (lambda v: v, lambda v: base64.urlsafe_b64decode(v).decode("utf-8")):
        try:
            config = json.loads(decode(value))
        except (ValueError, UnicodeDecodeError, binascii.Error):
            continue
        if isinstance(config, dict):
            return config
    where = "" if os.path.isabs(value) else f" (a relative path, opened from the working directory {os.getcwd()})"
    raise ConfigError(f"the DeepSpeed config file of this accelerate launch, {value!r}, does not exist{where}. "
                      "accelerate opens `deepspeed_config_file` from the folder you launch in: give its absolute path, "
                      "or launch from the folder it is relative to")


def warn_of_unreadable_accelerate_config() -> None:
    """At `import hf_zero3_loader.auto`: an `accelerate launch` whose DeepSpeed config file is not found from here
    fails at the script's first `TrainingArguments` or `Accelerator`, in accelerate, with a JSONDecodeError and
    "Expected a string path to an existing deepspeed config": say first which file, and why."""
    from . import log

    value = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true" or not value or value.lower() == "none":
        return
    try:
        accelerate_config_file(value)
    except ConfigError as e:
        log.warning_once("accelerate config file", "%s", e)


def _from_accelerate_env() -> tuple[dict, bool] | None:
    """The config an `accelerate launch --use_deepspeed` process will train with, before its `Accelerator` exists:
    built by accelerate's own `DeepSpeedPlugin` from the environment the launcher set (the config file, or the
    plugin's fields: stage, offload devices, ...) with the launch's mixed precision, and the
    "auto" batch sizes resolved as accelerate resolves them for `zero.Init` (`set_deepspeed_weakref`); and whether
    the launch builds models under `zero.Init` (`--zero3_init_flag`, read by the plugin)."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return None
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    from_file = accelerate_config_file(path) if path and path.lower() != "none" else None  # unreadable: named
    if from_file is None and os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") is None:
        return None
    from accelerate.utils import DeepSpeedPlugin

    try:
        plugin = DeepSpeedPlugin(hf_ds_config=from_file)  # None: the plugin's fields from the environment
        plugin.set_mixed_precision(os.environ.get("ACCELERATE_MIXED_PRECISION", "no"))
    except ValueError as e:  # what the script's Accelerator() would raise
        raise ConfigError(f"the DeepSpeed config of this accelerate launch: {e}") from e
    config = with_auto_batch_sizes_resolved(plugin.deepspeed_config)
    _warn_of_unforwarded_nvme_path(config)
    return config, bool(plugin.zero3_init_flag)


def with_auto_batch_sizes_resolved(config: dict) -> dict:
    """A copy of `config` whose "auto" batch sizes are resolved as accelerate resolves them for `zero.Init`
    (`DeepSpeedPlugin.set_deepspeed_weakref`): the partitions do not depend on them, and DeepSpeed's config parser
    fails on the string ("'>' not supported between instances of 'str' and 'int'"). A config written for the
    Trainer (transformers' docs' ds_config_zero3.json) says "auto" until the Trainer fills it in; the engine gets the
    caller's own config."""
    config = copy.deepcopy(config)
    for key in ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu"):
        if config.get(key, "auto") == "auto":
            config[key] = 1
    if config.get("train_batch_size") == "auto":
        del config["train_batch_size"]
    return config


def _warn_of_unforwarded_nvme_path(config: dict) -> None:
    """accelerate 1.15's launcher does not pass `--offload_param_nvme_path` / `--offload_optimizer_nvme_path` on to
    its processes, so its plugin (and the engine) use the string "none" as the folder: swap files land in `./none`,
    on whatever disk holds the working directory. Say so; a DeepSpeed config file's `nvme_path` is forwarded."""
    from . import log

    zero = config.get("zero_optimization") or {}
    for section in ("offload_param", "offload_optimizer"):
        offload = zero.get(section) or {}
        if str(offload.get("device", "")).lower() == "nvme" and str(offload.get("nvme_path", "")).lower() == "none":
            log.warning_once(f"nvme_path none {section}",
                             "%s.nvme_path is 'none' in this accelerate launch (accelerate's launcher does not forward "
                             "--%s_nvme_path): DeepSpeed will swap to ./none under the working directory. Give "
                             "the folder in a DeepSpeed config file (--deepspeed_config_file) instead.",
                             section, section)


def accelerate_deepspeed_plugins() -> list:
    """The DeepSpeed plugins of this process's accelerate state (one, or several named ones), if any."""
    state = accelerate_shared_state()
    if state is None:  # accelerate not installed
        return []
    found = state.get("deepspeed_plugins") or state.get("deepspeed_plugin")
    return list(found.values()) if isinstance(found, dict) else [found] if found is not None else []


def find_deepspeed_setup(ds_config: dict | str | None = None) -> DeepSpeedSetup | None:
    if ds_config is not None:
        config = _load_json(ds_config) if isinstance(ds_config, (str, os.PathLike)) else dict(ds_config)
        return DeepSpeedSetup(with_auto_batch_sizes_resolved(config), "ds_config argument")
    from transformers.integrations.deepspeed import deepspeed_config

    if deepspeed_config() is not None:  # the Trainer's has its batch sizes filled in; one built by hand may not
        return DeepSpeedSetup(with_auto_batch_sizes_resolved(deepspeed_config()), "transformers HfDeepSpeedConfig")
    plugins = accelerate_deepspeed_plugins()
    plugin = plugins[0] if len(plugins) == 1 else next((p for p in plugins if getattr(p, "selected", False)), None)
    if plugin is not None and getattr(plugin, "deepspeed_config", None):  # of several named plugins: the active one
        return DeepSpeedSetup(with_auto_batch_sizes_resolved(plugin.deepspeed_config), "accelerate AcceleratorState",
                              zero_init=bool(getattr(plugin, "zero3_init_flag", True)))
    found = _from_accelerate_env()
    return DeepSpeedSetup(found[0], "accelerate launch environment", zero_init=found[1]) if found else None


def unpartitioned_reason(setup: DeepSpeedSetup | None) -> str:
    """Why a load is not one into ZeRO-3 partitions (`setup` does not partition at load), in words."""
    if setup is None:
        return "no DeepSpeed config found (none given, and none from the Trainer, accelerate or `accelerate launch`)"
    if setup.stage == 3:
        return (f"ZeRO-3 with zero3_init_flag false ({setup.found_via}): deepspeed.initialize partitions the model "
                "after the load")
    return f"ZeRO stage {setup.stage} ({setup.found_via})"


def nvme_param_offload(config: dict | None) -> dict | None:
    """The `offload_param` section when it offloads to NVMe, else None."""
    offload = ((config or {}).get("zero_optimization") or {}).get("offload_param") or {}
    return offload if str(offload.get("device", "none")).lower() == "nvme" else None


@functools.lru_cache(maxsize=None)
def async_io_buildable() -> bool:
    """Whether DeepSpeed's async_io op (NVMe swapping) can be built here: its builder probes for libaio with the
    compiler (0.05-0.17 s), so once per process."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    return builder is not None and builder.is_compatible(verbose=False)


def local_device() -> torch.device:
    """This rank's device: LOCAL_RANK's, as DeepSpeed's `zero.Init` takes it; without LOCAL_RANK (a script that
    starts its own processes, e.g. `torch.multiprocessing.spawn`), the device the script made current."""
    from deepspeed.accelerator import get_accelerator

    if "LOCAL_RANK" in os.environ:
        return torch.device(get_accelerator().device_name(int(os.environ["LOCAL_RANK"])))
    return torch.device(get_accelerator().current_device_name())


def check_supported(setup: DeepSpeedSetup) -> None:
    """What DeepSpeed would refuse later with a bare error, said up front: `zero.Init` takes the rank's device from
    LOCAL_RANK (a `KeyError` on transformers' path too), and NVMe parameter offload needs DeepSpeed's async_io op,
    built on first use against libaio (else the op builder's compile error)."""
    if "LOCAL_RANK" not in os.environ:
        raise ConfigError("LOCAL_RANK is not set: DeepSpeed ZeRO-3 (zero.Init) takes each rank's device from it "
                          "(transformers' own ZeRO-3 path fails with KeyError: 'LOCAL_RANK'). Launch with torchrun, "
                          "`accelerate launch` or `deepspeed`, or set os.environ['LOCAL_RANK'] to the process's index "
                          "on its machine before loading (with torch.multiprocessing.spawn: the index it passes)")
    offload = nvme_param_offload(setup.config)
    if offload is not None:
        if not offload.get("nvme_path"):
            raise ConfigError("offload_param.device='nvme' needs offload_param.nvme_path (a folder on a fast local "
                              "disk for the parameter swap files)")
        if not async_io_buildable():
            raise ConfigError("NVMe parameter offload (offload_param.device='nvme') needs DeepSpeed's async_io op, "
                              "which cannot be built here: install libaio (e.g. `apt install libaio-dev`)")
        bad = arch_list_the_op_builder_cannot_parse("async_io")
        if bad:  # DeepSpeed's own message is "invalid literal for int() with base 10: '0a'", on transformers' path too
            raise ConfigError(f"NVMe parameter offload needs DeepSpeed's async_io op, built on first use, and "
                              f"DeepSpeed's op builder cannot parse {', '.join(map(repr, bad))} in "
                              f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']!r}: set plain compute "
                              f"capabilities for the build, e.g. TORCH_CUDA_ARCH_LIST=\"9.0\"")


def resolve_dtype(setup: DeepSpeedSetup, requested, strict: bool = False) -> torch.dtype | str:
    """The dtype parameters are loaded in: the engine's. DeepSpeed holds (and transformers' own ZeRO-3 path casts)
    every parameter in the engine's dtype whatever `dtype` says, so a different explicit `dtype` is overridden with a
    warning (TRL passes `dtype=torch.float32` by default), or refused with `strict_dtype=True`."""
    from . import log

    if isinstance(requested, str) and requested != "auto":
        requested = getattr(torch, requested)
    engine = setup.dtype
    if engine is None:
        return requested if requested is not None else "auto"
    if requested not in (None, "auto") and requested != engine:
        if strict:
            raise ConfigError(
                f"dtype={requested} conflicts with the DeepSpeed config, which trains in {engine} "
                f"({setup.found_via}) (strict_dtype=True). Drop `dtype` or change the config.")
        log.warning_once(f"dtype {requested} {engine}",
                         "dtype=%s is overridden: DeepSpeed trains in %s (%s), and ZeRO holds every parameter in the "
                         "engine's dtype, as transformers' own ZeRO-3 path does. Pass strict_dtype=True to make this "
                         "an error.", requested, engine, setup.found_via)
    return engine
