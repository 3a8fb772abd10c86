"""A private hook of transformers or DeepSpeed, declared with the shape the loader expects of it, and the check that it
is there (`_transformers_private.HOOKS`, `_deepspeed_private.HOOKS`; `compat.py` runs the checks at the first load).

A hook is named `module:Qualified.name`. Its check imports the module, follows the attributes, and, where declared,
compares what it finds with what the loader does with it: a callable's first parameters (those the loader passes
positionally, or, `exact`, every parameter: transformers calls the loader's replacement with them), the keywords the
loader passes, a staticmethod, a dataclass's fields, names its source text sets (instance attributes, which exist only
on a built object). Nothing is called. `HF_ZERO3_LOADER_SIMULATE_MISSING_HOOK` (test-only: comma-separated hook names,
full or by their last part) reports hooks as missing that are there.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
from dataclasses import dataclass

SIMULATE_ENV = "HF_ZERO3_LOADER_SIMULATE_MISSING_HOOK"  # test-only

LOAD, SAVE, EP, CLI, TESTS = "load", "save", "expert parallelism", "command line", "tests"
TRAINER = "Trainer.save_model"  # a PEFT adapter written by the Trainer's own writer


@dataclass(frozen=True)
class Hook:
    path: str  # "transformers.modeling_utils:PreTrainedModel._load_pretrained_model"
    uses: tuple[str, ...] = (LOAD,)  # what needs it: a load, a save, expert parallelism, ...
    params: tuple[str, ...] = ()  # a callable whose first parameters are these, in order
    exact: bool = False  # ... and no others (the loader's replacement is called with them)
    keywords: tuple[str, ...] = ()  # a callable that takes these by name
    static: bool = False  # a staticmethod of its class
    fields: tuple[str, ...] = ()  # a dataclass with these fields
    source: tuple[str, ...] = ()  # its source text holds these (attributes set on built objects)

    @property
    def name(self) -> str:
        return self.path.replace(":", ".")

    def problem(self) -> str | None:
        """What is missing or changed, in words; None when the hook is as expected."""
        module_name, _, qualname = self.path.partition(":")
        try:
            owner, obj = None, importlib.import_module(module_name)
        except Exception as e:  # ImportError, or whatever a changed module raises on import
            return f"module {module_name} cannot be imported ({type(e).__name__}: {e})"
        for part in qualname.split(".") if qualname else ():
            if not hasattr(obj, part):
                return "not found"
            owner, obj = obj, getattr(obj, part)
        if self.static and not isinstance(inspect.getattr_static(owner, qualname.rsplit(".", 1)[-1]), staticmethod):
            return "no longer a staticmethod"
        if self.params or self.exact or self.keywords:
            if not callable(obj):
                return "not callable"
            try:
                parameters = inspect.signature(obj).parameters
            except (TypeError, ValueError):
                return "its signature cannot be read"
            names = list(parameters)
            if names[:len(self.params)] != list(self.params) or (self.exact and names != list(self.params)):
                expected = ", ".join(self.params) + ("" if self.exact else ", ...")
                return f"parameters ({', '.join(names)}), expected ({expected})"
            absent = [k for k in self.keywords if k not in parameters]
            if absent:
                return f"takes no {', '.join(absent)}"
        if self.fields:
            if not dataclasses.is_dataclass(obj):
                return "no longer a dataclass"
            absent = [f for f in self.fields if f not in {f.name for f in dataclasses.fields(obj)}]
            if absent:
                return f"has no field {', '.join(absent)}"
        if self.source:
            try:
                text = _source_text(obj)
            except (OSError, TypeError):
                return "its source cannot be read"
            absent = [s for s in self.source if s not in text]
            if absent:
                return f"its source no longer names {', '.join(absent)}"
        return None


_problems: dict[str, str | None] = {}  # hook path -> its problem (None: fine), once per process


def simulated_missing() -> list[str]:
    return [s.strip() for s in os.environ.get(SIMULATE_ENV, "").split(",") if s.strip()]


def _simulated(hook: Hook, names: list[str]) -> bool:
    return any(hook.path == n or hook.name == n or hook.name.endswith("." + n) for n in names)


def missing(hooks, uses: tuple[str, ...] = ()) -> list[str]:
    """"name: problem" for each hook of `hooks` (those any of `uses` needs; all when empty) that is missing or
    changed. Each hook is checked once per process."""
    simulated = simulated_missing()
    out = []
    for hook in hooks:
        if uses and not set(uses) & set(hook.uses):
            continue
        if hook.path not in _problems:
            try:
                _problems[hook.path] = hook.problem()
            except Exception as e:  # a check must never be what fails
                _problems[hook.path] = f"cannot be checked ({type(e).__name__}: {e})"
        problem = _problems[hook.path]
        if problem is None and _simulated(hook, simulated):
            problem = f"not found (simulated: {SIMULATE_ENV})"
        if problem is not None:
            out.append(f"{hook.name}: {problem}")
    return out


def forget() -> None:
    """Check again at the next call (tests)."""
    _problems.clear()


def _source_text(obj) -> str:
    """The source text a `source` check searches. A class's is the source of the functions it defines (where its
    objects' attributes are set): `inspect.getsource` of a class parses its whole module (0.28 s for DeepSpeed's
    `partition_parameters`, at every process's first load), a function's reads only its own lines."""
    if not inspect.isclass(obj):
        return inspect.getsource(obj)
    parts = []
    for value in vars(obj).values():
        function = value.__func__ if isinstance(value, (staticmethod, classmethod)) else (
            value.fget if isinstance(value, property) else value)
        if inspect.isfunction(function):
            try:
                parts.append(inspect.getsource(function))
            except (OSError, TypeError):  # made at run time (no source lines): it sets nothing the check looks for
                pass
    if not parts:
        raise OSError("no function of its own")
    return "\n".join(parts)

