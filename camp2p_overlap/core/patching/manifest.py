"""Load the declarative patch manifests (``patches/*.toml``) and check live
objects against them."""

from __future__ import annotations

import functools
import inspect
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any, Literal

from camp2p_overlap.core.patching.features import FEATURES
from camp2p_overlap.core.patching.versions import COMMIT_SHOWN, VersionCheck, check_stack

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

#: The parameter kinds a signature names (``inspect.Parameter.kind.name``).
_KINDS = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD", "VAR_POSITIONAL", "KEYWORD_ONLY", "VAR_KEYWORD")

MANIFEST_PACKAGE = "camp2p_overlap.patches"
DEFAULT_STACK = "vllm-0.19.1"
_COMMIT = re.compile(r"[0-9a-f]{40}")


class ManifestError(ValueError):
    """A manifest file is malformed."""


@dataclass(frozen=True)
class ParamSpec:
    name: str
    kind: str
    default: str | None = None  # repr() of the default; None = no default

    def describe(self) -> str:
        text = f"{self.name} ({self.kind})"
        return text if self.default is None else f"{text} = {self.default}"


@dataclass(frozen=True)
class TargetSpec:
    module: str
    qualname: str
    #: ``wrap``: our wrapper replaces the class attribute; ``read``: read by
    #: our code, only checked; ``route``: checked, nothing installed on the
    #: class; an engaged step routes the instance's calls for its duration.
    action: Literal["wrap", "read", "route"]
    wrapper: str | None
    signature: tuple[ParamSpec, ...]
    changes: str
    why: str
    #: For ``route``: the key of the router an engaged step binds on the instance.
    router: str | None = None
    #: The feature (a key of ``core.patching.features.FEATURES``) that alone
    #: needs this target: missing or changed, it refuses that feature only
    #: and its module is still installed. None: required (it refuses its module).
    optional: str | None = None
    #: Why the target is optional (the manifest's ``optional_why``).
    optional_why: str = ""

    @property
    def id(self) -> str:
        return f"{self.module}.{self.qualname}"

    @functools.cached_property
    def owner_path(self) -> tuple[str, ...]:
        """The attribute path from the module to the owner (empty for a
        module-level function)."""
        return tuple(self.qualname.split(".")[:-1])

    @functools.cached_property
    def attribute(self) -> str:
        return self.qualname.split(".")[-1]


@dataclass(frozen=True)
class ModuleSpec:
    name: str
    targets: tuple[TargetSpec, ...]


@dataclass(frozen=True)
class StackManifest:
    name: str
    vllm: str
    remove_when: str
    modules: tuple[ModuleSpec, ...]
    source: str
    #: The afd-plugin distribution version (``vllm-afd-plugin``) the targets
    #: were checked against; None when the stack does not pin one.
    afd_plugin: str | None = None
    #: Where that afd-plugin came from (branch and commit), for people.
    afd_plugin_source: str = ""
    #: The full afd-plugin commit the targets were checked against, for a
    #: stack that follows an untagged branch (exclusive with ``afd_plugin``).
    afd_plugin_commit: str | None = None
    #: The vLLM-Ascend line this stack runs with, in words (informational).
    vllm_ascend: str = ""
    #: The vLLM-Ascend commit checked, where that line is no release
    #: (``doctor`` compares an installed vllm_ascend with it; not gated).
    vllm_ascend_commit: str | None = None

    def describe(self) -> str:
        """``vLLM 0.19.1 with afd-plugin 0.19.1rc1 (stack vllm-0.19.1)`` (or ``commit 2e4378f2d``)."""
        label = f"commit {self.afd_plugin_commit[:COMMIT_SHOWN]}" if self.afd_plugin_commit else self.afd_plugin
        afd = f" with afd-plugin {label}" if label else ""
        return f"vLLM {self.vllm}{afd} (stack {self.name})"

    def targets(self) -> tuple[TargetSpec, ...]:
        return tuple(t for m in self.modules for t in m.targets)

    def module(self, name: str) -> ModuleSpec:
        return {m.name: m for m in self.modules}[name]

    def rebased(self, old_root: str, new_root: str) -> StackManifest:
        """The same manifest with module names moved from package ``old_root``
        to ``new_root`` (the benchmark uses this when a real afd_plugin is
        installed, so its stand-ins never shadow the real package)."""

        def move(name: str) -> str:
            if name == old_root or name.startswith(old_root + "."):
                return new_root + name[len(old_root) :]
            return name

        modules = tuple(
            ModuleSpec(move(m.name), tuple(replace(t, module=move(t.module)) for t in m.targets)) for m in self.modules
        )
        return replace(self, modules=modules)


def _require(table: dict[str, Any], key: str, where: str) -> Any:
    if key not in table:
        raise ManifestError(f"{where}: missing key {key!r}")
    return table[key]


def _commit(stack: dict[str, Any], key: str, source: str) -> str | None:
    value = stack.get(key)
    if value is not None and not (isinstance(value, str) and _COMMIT.fullmatch(value)):
        raise ManifestError(f"{source}: [stack] {key} must be a full 40-digit lower-case git commit id")
    return value


def _optional(tgt: dict[str, Any], action: str, where: str) -> tuple[str | None, str]:
    """A target's ``optional`` feature and ``optional_why``, validated."""
    optional, why = tgt.get("optional"), tgt.get("optional_why")
    if optional is None:
        if why is not None:
            raise ManifestError(f"{where}: 'optional_why' without 'optional'")
        return None, ""
    known = ", ".join(repr(f) for f in sorted(FEATURES))
    if not isinstance(optional, str) or optional not in FEATURES:
        raise ManifestError(f"{where}: optional = {optional!r} is not a known feature (known: {known})")
    if action == "route":
        raise ManifestError(f"{where}: a 'route' target cannot be optional (an engaged step routes every one)")
    if not isinstance(why, str) or not why.strip():
        raise ManifestError(
            f"{where}: an optional target needs an 'optional_why' saying why only {optional!r} needs it"
        )
    return optional, why.strip()


def parse_manifest(text: str, source: str = "<string>") -> StackManifest:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{source}: {exc}") from exc
    stack = _require(data, "stack", source)
    modules: list[ModuleSpec] = []
    for mod in _require(data, "module", source):
        mname = _require(mod, "name", source)
        targets: list[TargetSpec] = []
        for tgt in _require(mod, "target", f"{source}: module {mname}"):
            where = f"{source}: {mname}.{tgt.get('qualname', '?')}"
            action = _require(tgt, "action", where)
            if action not in ("wrap", "read", "route"):
                raise ManifestError(f"{where}: action must be 'wrap', 'read' or 'route', not {action!r}")
            wrapper = tgt.get("wrapper")
            if action == "wrap" and not wrapper:
                raise ManifestError(f"{where}: a 'wrap' target needs a 'wrapper'")
            router = tgt.get("router")
            if action == "route" and not router:
                raise ManifestError(f"{where}: a 'route' target needs a 'router'")
            if action != "wrap" and wrapper:
                raise ManifestError(f"{where}: only a 'wrap' target names a 'wrapper'")
            if action != "route" and router:
                raise ManifestError(f"{where}: only a 'route' target names a 'router'")
            if action == "route" and "." not in str(tgt.get("qualname", "")):
                raise ManifestError(f"{where}: a 'route' target is a class attribute (Class.method)")
            optional, optional_why = _optional(tgt, action, where)
            params = []
            for p in _require(tgt, "signature", where):
                kind = _require(p, "kind", where)
                if kind not in _KINDS:
                    raise ManifestError(f"{where}: unknown parameter kind {kind!r}")
                params.append(ParamSpec(_require(p, "name", where), kind, p.get("default")))
            targets.append(
                TargetSpec(
                    module=mname,
                    qualname=_require(tgt, "qualname", where),
                    action=action,
                    wrapper=wrapper,
                    signature=tuple(params),
                    changes=str(tgt.get("changes", "")).strip(),
                    why=str(tgt.get("why", "")).strip(),
                    router=router,
                    optional=optional,
                    optional_why=optional_why,
                )
            )
        modules.append(ModuleSpec(mname, tuple(targets)))
    afd_plugin = stack.get("afd_plugin")
    if afd_plugin is not None and not isinstance(afd_plugin, str):
        raise ManifestError(f"{source}: [stack] afd_plugin must be a version string")
    commit = _commit(stack, "afd_plugin_commit", source)
    if commit is not None and afd_plugin is not None:
        raise ManifestError(f"{source}: [stack] pins afd-plugin by afd_plugin or by afd_plugin_commit, not both")
    return StackManifest(
        name=_require(stack, "name", source),
        vllm=_require(stack, "vllm", source),
        remove_when=str(stack.get("remove_when", "")).strip(),
        modules=tuple(modules),
        source=source,
        afd_plugin=afd_plugin,
        afd_plugin_source=str(stack.get("afd_plugin_source", "")).strip(),
        afd_plugin_commit=commit,
        vllm_ascend=str(stack.get("vllm_ascend", "")).strip(),
        vllm_ascend_commit=_commit(stack, "vllm_ascend_commit", source),
    )


def _manifest_root() -> Any:
    """Where the manifests are: the package ``camp2p_overlap.patches``, read
    through ``importlib.resources``. In a checkout (editable install, or
    ``PYTHONPATH`` set to it) that package is the committed symbolic link
    ``camp2p_overlap/patches -> ../patches``; a wheel or an sdist holds the
    files themselves."""
    try:
        return resources.files(MANIFEST_PACKAGE)
    except ModuleNotFoundError:
        raise ManifestError(
            f"the manifests are missing: {MANIFEST_PACKAGE} is not importable (in a checkout it is the "
            "symbolic link camp2p_overlap/patches -> ../patches: a copy that drops links loses it; "
            "reinstall the package, or copy the checkout keeping its links)"
        ) from None


def available_stacks() -> list[str]:
    root = _manifest_root()
    return sorted(p.name[: -len(".toml")] for p in root.iterdir() if p.name.endswith(".toml"))


def load_manifest(stack: str = DEFAULT_STACK) -> StackManifest:
    """Load the manifest of ``stack`` from ``camp2p_overlap.patches``."""
    path = _manifest_root() / f"{stack}.toml"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ManifestError(
            f"no manifest for stack {stack!r}; shipped: {', '.join(available_stacks()) or 'none'}"
        ) from None
    return parse_manifest(text, source=f"patches/{stack}.toml")


def load_manifests() -> tuple[StackManifest, ...]:
    """Every shipped stack's manifest, in name order: the patch engine picks
    the one whose pinned versions match what is installed."""
    stacks = available_stacks()
    if not stacks:
        raise ManifestError(f"no manifest is shipped in {MANIFEST_PACKAGE}")
    return tuple(load_manifest(name) for name in stacks)


def signature_of(obj: Callable[..., Any]) -> tuple[ParamSpec, ...]:
    """The parameters of ``obj`` in manifest form."""
    sig = inspect.signature(obj)
    out = []
    for p in sig.parameters.values():
        default = None if p.default is inspect.Parameter.empty else repr(p.default)
        out.append(ParamSpec(p.name, p.kind.name, default))
    return tuple(out)


def signature_difference(expected: tuple[ParamSpec, ...], actual: tuple[ParamSpec, ...]) -> str | None:
    """A human sentence describing how ``actual`` differs from ``expected``,
    or None when they match."""
    if expected == actual:
        return None
    exp_names = [p.name for p in expected]
    act_names = [p.name for p in actual]
    missing = [n for n in exp_names if n not in act_names]
    extra = [n for n in act_names if n not in exp_names]
    parts = []
    if missing:
        parts.append(f"missing parameter(s) {', '.join(missing)}")
    if extra:
        parts.append(f"unexpected parameter(s) {', '.join(extra)}")
    if not parts:
        for e, a in zip(expected, actual, strict=True):
            if e != a:
                parts.append(f"parameter {e.describe()} is now {a.describe()}")
        if exp_names != act_names and not parts:
            parts.append(f"parameter order {act_names} differs from {exp_names}")
    return "; ".join(parts) or "signature differs"


def stack_version_check(manifest: StackManifest) -> VersionCheck:
    """The installed versions against one stack's pins."""
    return check_stack(manifest.vllm, manifest.afd_plugin, manifest.afd_plugin_commit)


def check_stacks(
    stacks: Sequence[StackManifest], version_check: Callable[[StackManifest], VersionCheck] = stack_version_check
) -> list[tuple[StackManifest, VersionCheck]]:
    """Every stack with its check, in the order given (``doctor`` shows them all)."""
    if not stacks:
        raise ManifestError("no stack manifest to choose from")
    return [(m, version_check(m)) for m in stacks]


def select_stack(
    stacks: Sequence[StackManifest], version_check: Callable[[StackManifest], VersionCheck] = stack_version_check
) -> tuple[StackManifest, VersionCheck]:
    """The stack that serves this process: the first whose check passes, with
    that check. Otherwise a failed check: that of the stack pinning the
    installed vLLM when there is one (its afd-plugin differs), else of the
    first stack; with several stacks its reason names them all."""
    return select_checked(check_stacks(stacks, version_check))


def select_checked(checks: Sequence[tuple[StackManifest, VersionCheck]]) -> tuple[StackManifest, VersionCheck]:
    """:func:`select_stack` over checks already made (``check_stacks``)."""
    for m, vc in checks:
        if vc.ok:
            return m, vc
    m, vc = next(((m, vc) for m, vc in checks if vc.vllm_ok), checks[0])
    if len(checks) == 1:
        return m, vc
    why = f"{vc.installed}; camp2p-overlap supports {'; '.join(s.describe() for s, _ in checks)}"
    return m, VersionCheck(False, vc.found, vc.supported, why, vc.installed, vc.vllm_ok)
