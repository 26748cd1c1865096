"""Which torch_npu builds capture a multi-stream ACL graph correctly, and
whether the installed one does (read from its distribution: neither
torch_npu nor torch is imported). The fix (Ascend/pytorch !32803 on master;
!32564 on v2.9.0, !32804 v2.7.1, !32805 v2.8.0, !32806 v2.10.0, !32807
v2.11.0, !32808-!32811 the ``-26.0.0`` branches), why the overlap variant of
a decode graph needs it, and how a build is judged (:func:`judge_capture_fix`):
docs/design.md "Decode graphs".

**The table** (:data:`BUILDS`): every release tag of lines 2.7 to 2.13
from ``v7.3.0`` on, each with the version its ``version.txt`` reads, the
commit the tag names and whether that commit's ``NPUEvent.cpp`` has
``hasCapturesUnderway``, all read from the Ascend/pytorch repository. The
tag ``v26.2.0-beta.1-pytorch2.13.0`` is left out: its ``version.txt`` lists
several versions, and its line has the fix anyway. The commits known are
the tags' only (a wheel built from a tag reports it as ``git_version``).
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from camp2p_overlap.core.patching.versions import COMMIT_SHOWN

#: Distribution names torch_npu is published under (metadata normalizes
#: them; both are tried).
TORCH_NPU_DISTS = ("torch-npu", "torch_npu")
#: The file of the distribution that holds ``git_version``.
VERSION_FILE = "torch_npu/version.py"
#: What the fix is called in every reason.
FIX = "the multi-stream graph capture fix (Ascend/pytorch !32803)"
#: The start of every graph-variant refusal (the step summary finds them by it).
GRAPH_VARIANTS_REFUSED = "decode graph variants refused"
#: ``setup.py``'s ``git_version`` when the tree had no git.
_NO_GIT = "unknown"


@dataclass(frozen=True)
class Build:
    """One release tag of torch_npu."""

    tag: str
    version: str  # its version.txt
    commit: str  # the commit the tag names
    fixed: bool  # its NPUEvent.cpp has hasCapturesUnderway


#: Every release tag of lines 2.7-2.13 from v7.3.0 on (sources: the module docstring).
BUILDS: tuple[Build, ...] = (
    Build("v7.3.0-pytorch2.7.1", "2.7.1.post2", "3be71f46df8b8ad10f4e4230aa67d83e68a48ba4", False),
    Build("v7.3.0-pytorch2.8.0", "2.8.0.post2", "729dda3516b997462560a1e12b06a8efb9288494", False),
    Build("v7.3.0-pytorch2.9.0", "2.9.0", "12d689a08941d4a6e45eab16e3ad6fef96a9affd", False),
    Build("v7.3.1-pytorch2.7.1", "2.7.1.post3", "b2f0c058bfe0a6f2b2c5e1a15a8ddcb4d706fea8", False),
    Build("v7.3.1-pytorch2.8.0", "2.8.0.post3", "613a02980681949bc23b2bba9937cd05ed1e5b41", False),
    Build("v7.3.1-pytorch2.9.0", "2.9.0.post1", "1927d97499992451d9b39547b4b5118fd2c08ab5", False),
    Build("v26.0.0-beta.1-pytorch2.10.0", "2.10.0", "924517bb95d6320c40e75eb2ca8446cd3841cdc1", False),
    Build("v26.0.0-pytorch2.7.1", "2.7.1.post4", "d99d6cda7b9ab4370e7c03f697302760b231538a", True),
    Build("v26.0.0-pytorch2.8.0", "2.8.0.post4", "f3ecfe4a7ef7395754da7ca2e35661a7132b519b", True),
    Build("v26.0.0-pytorch2.9.0", "2.9.0.post2", "912882db09313e70f5312212669cd71e02e5c5d8", True),
    Build("v26.0.0-pytorch2.10.0", "2.10.0", "94f8a8e6b523d7ba553e1b80d5b5248478391526", True),
    Build("v26.0.1-pytorch2.7.1", "2.7.1.post6", "582210a6f25a9e2fc1e7a397a24e517d7b3840bc", True),
    Build("v26.0.1-pytorch2.8.0", "2.8.0.post5", "0a3141fd8bcff3afdbaa5e468da6af22b1b1f15d", True),
    Build("v26.0.1-pytorch2.9.0", "2.9.0.post4", "22891d911dbfe420aea04c1c756498b33bed59a2", True),
    Build("v26.0.1-pytorch2.10.0", "2.10.0.post2", "8751b36d5d6959e499e6bf6530c1928060ced030", True),
    Build("v26.1.0-beta.1-pytorch2.7.1", "2.7.1.post5", "51ebc164c655afdaf4cf15588f71bf572b4e8e37", True),
    Build("v26.1.0-beta.1-pytorch2.9.0", "2.9.0.post3", "0814ee057fb8fb7689c58ca702b152969a3ab267", True),
    Build("v26.1.0-beta.1-pytorch2.10.0", "2.10.0.post1", "eb20caed7945119755dc3a98d50c0b7b49e779ba", True),
    Build("v26.1.0-beta.1-pytorch2.11.0", "2.11.0", "7c6893fb9e7db59dc6af9bb659815a37c8f3c745", True),
    Build("v26.1.0-beta.1-pytorch2.12.0", "2.12.0", "edcfe72a6bb4692960f00eb38148d92ce1f5505c", True),
    Build("v26.1.0-beta.2-pytorch2.7.1", "2.7.1.post7", "ec51e0445bc457e96073913913fdb4b07445a410", True),
    Build("v26.1.0-beta.2-pytorch2.9.0", "2.9.0.post5", "622c37c1175219900ba56d1b1d7b6fc849a6a62e", True),
    Build("v26.1.0-beta.2-pytorch2.10.0", "2.10.0.post3", "726214e9d0e8c412d643e1dade195cce249211e9", True),
    Build("v26.1.0-beta.2-pytorch2.11.0", "2.11.0", "379ad8e4c65c224945681ea52fd039ac996df08b", True),
    Build("v26.1.0-beta.2-pytorch2.12.0", "2.12.0", "5462a1b3352e91893fdf65994b45a4b613b24861", True),
    Build("v26.1.0-pytorch2.7.1", "2.7.1.post8", "a783f11e456f27d7451a1ea745f1556823357c95", True),
    Build("v26.1.0-pytorch2.9.0", "2.9.0.post6", "334dadc9a4a80a9c04ac6ec3c92182ccf525d46a", True),
    Build("v26.1.0-pytorch2.10.0", "2.10.0.post4", "5dd8ef3f9b375b5ae4a83538d5785754148c3302", True),
    Build("v26.1.0-pytorch2.11.0", "2.11.0", "2a40bad989cfb3bb8fe24d1fe3ff0f1babac33bb", True),
    Build("v26.1.0-pytorch2.12.0", "2.12.0", "fa0f83fe49d309dcbc31e264e9e6ed6e5dc49d2d", True),
    Build("v26.2.0-0day-pytorch2.13.0", "2.13.0", "46936d18a18ba219fc5ed310fe2cc6409f94114b", True),
    Build("v26.2.0-beta.1-pytorch2.7.1", "2.7.1.post9", "05c4d4c1676ea80dc1870700c46323e0a2291cc3", True),
    Build("v26.2.0-beta.1-pytorch2.9.0", "2.9.0.post7", "4e7f48f5cd3017e16e66f9544e39dc49bb64f0bc", True),
    Build("v26.2.0-beta.1-pytorch2.10.0", "2.10.0.post5", "7dffbb4761984337cce432d37cec940b5991e09f", True),
    Build("v26.2.0-beta.1-pytorch2.11.0", "2.11.0.post1", "c360d2c1755051e5044fe4d1202c006c5bc12713", True),
    Build("v26.2.0-beta.1-pytorch2.12.0", "2.12.0.post1", "7c9142c33ced951834c881c4d0ea57eb1074242a", True),
)

#: The version each release branch's version.txt read on the parent of its
#: fix commit: a source build at one of these may predate the fix.
PRE_FIX_VERSIONS = frozenset(
    Version(v) for v in ("2.7.1.post4", "2.8.0.post4", "2.9.0.post2", "2.10.0", "2.11.0", "2.12.0")
)
#: Lines before this one have no build with the fix.
FIRST_LINE_FIXED = (2, 7)
#: Lines after this one are not in the table; every line from
#: :data:`EVERY_BUILD_FIXED_FROM` on has the fix in all its builds.
NEWEST_LINE_KNOWN = (2, 13)
EVERY_BUILD_FIXED_FROM = (2, 11)


def _line(v: Version) -> tuple[int, int]:
    release = (*v.release, 0)
    return release[0], release[1]


def _line_text(line: tuple[int, int]) -> str:
    return f"{line[0]}.{line[1]}"


_FIXED = [b for b in BUILDS if b.fixed]
#: The first build with the fix of each line in the table (the earliest listed among equal versions).
FIRST_FIXED: dict[tuple[int, int], Build] = {
    line: min((b for b in _FIXED if _line(Version(b.version)) == line), key=lambda b: Version(b.version))
    for line in {_line(Version(b.version)) for b in _FIXED}
}
#: Versions that both a fixed and an unfixed release tag read.
SHARED_VERSIONS = frozenset(
    Version(b.version) for b in BUILDS if b.fixed and any(not o.fixed and o.version == b.version for o in BUILDS)
)


@dataclass(frozen=True)
class CaptureFixVerdict:
    """Whether a torch_npu build has :data:`FIX`."""

    fixed: bool
    #: The build as named in ``reason`` (version, and commit when known).
    installed: str
    #: The first version of the build's line with the fix, or None (a line
    #: older than every fixed one, a line newer than the table).
    first_fixed: str | None
    #: One sentence naming the installed version and ``first_fixed``.
    reason: str


def _commit(git_version: str | None, v: Version) -> str | None:
    """The build's commit: ``git_version``, else the ``+git<sha>`` label."""
    if git_version and git_version.strip().lower() != _NO_GIT:
        return git_version.strip().lower()
    m = re.fullmatch(r"git([0-9a-f]{7,40})", v.local or "")
    return m.group(1) if m else None


def _known(commit: str | None, public: Version) -> Build | None:
    """The tag built from ``commit`` (7 hex digits at least) whose version
    is ``public``, or None."""
    if commit is None or len(commit) < 7:
        return None
    return next((b for b in BUILDS if b.commit.startswith(commit) and Version(b.version) == public), None)


def judge_capture_fix(version: str, git_version: str | None) -> CaptureFixVerdict:
    """Whether the torch_npu build with distribution ``version`` and
    ``git_version`` (None when unread) has :data:`FIX` (rules: docs/design.md,
    "Decode graphs")."""
    try:
        v = Version(version)
    except InvalidVersion:
        return CaptureFixVerdict(
            False, version, None, f"torch_npu version {version!r} does not parse, so {FIX} cannot be confirmed"
        )
    commit = _commit(git_version, v)
    installed = f"torch_npu {version}" + (f" (commit {commit[:COMMIT_SHOWN]})" if commit else "")
    line = _line(v)
    first = FIRST_FIXED.get(line)
    first_text = f"{first.version} (tag {first.tag})" if first else ""
    on_line = f"first in {first_text} on the {_line_text(line)} line"

    def verdict(fixed: bool, why: str) -> CaptureFixVerdict:
        return CaptureFixVerdict(fixed, installed, first.version if first else None, f"{installed} {why}")

    public = Version(v.public)
    build = _known(commit, public)
    if build is not None:
        has = "has" if build.fixed else "lacks"
        return verdict(build.fixed, f"is tag {build.tag}, which {has} {FIX}; {on_line}")
    if line < FIRST_LINE_FIXED:
        oldest = FIRST_FIXED[FIRST_LINE_FIXED]
        return verdict(
            False,
            f"lacks {FIX}: no build of the {_line_text(line)} line has it "
            f"(the oldest line with it is {_line_text(FIRST_LINE_FIXED)}, from {oldest.version})",
        )
    if line > NEWEST_LINE_KNOWN or first is None:
        return verdict(True, f"has {FIX}: it is in every line from {_line_text(EVERY_BUILD_FIXED_FROM)} on")
    if public < Version(first.version):
        return verdict(False, f"lacks {FIX}, {on_line}")
    if public in SHARED_VERSIONS or (v.local is not None and public in PRE_FIX_VERSIONS):
        commit_text = "names no commit" if commit is None else "names no release tag's commit"
        return verdict(
            False,
            f"cannot be told from an earlier {public} without {FIX}, as it {commit_text}; {on_line}: "
            "check that torch_npu/csrc/core/npu/NPUEvent.cpp of the commit it was built from calls "
            f"hasCapturesUnderway, or install a version after {public}",
        )
    return verdict(True, f"has {FIX}, {on_line}")


@dataclass(frozen=True)
class InstalledTorchNpu:
    version: str
    #: ``git_version`` of its ``torch_npu/version.py``; None when unread.
    git_version: str | None


_GIT_VERSION = re.compile(r"""^git_version\s*=\s*(['"])(.*?)\1""", re.MULTILINE)


def _distribution() -> importlib.metadata.Distribution | None:
    for name in TORCH_NPU_DISTS:
        try:
            return importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _git_version(dist: importlib.metadata.Distribution) -> str | None:
    """``git_version = '...'`` of the distribution's ``torch_npu/version.py``
    (from its RECORD, else where the dist-info's root puts it)."""
    path = next((f for f in dist.files or () if f.as_posix() == VERSION_FILE), VERSION_FILE)
    try:
        text = dist.locate_file(path).read_text(encoding="utf-8")  # type: ignore[union-attr]
    except (OSError, UnicodeDecodeError, AttributeError, NotImplementedError):
        return None
    m = _GIT_VERSION.search(text)
    return m.group(2) if m else None


@functools.lru_cache(maxsize=1)
def installed_torch_npu() -> InstalledTorchNpu | None:
    """The installed torch_npu distribution (read once per process:
    :func:`reset_cache` forgets it), or None when none is installed."""
    dist = _distribution()
    if dist is None:
        return None
    return InstalledTorchNpu(dist.version, _git_version(dist))


def reset_cache() -> None:
    """Read the installed distribution again on the next call (tests)."""
    installed_torch_npu.cache_clear()


def installed_capture_fix() -> CaptureFixVerdict | None:
    """The installed torch_npu's verdict, or None when none is installed."""
    found = installed_torch_npu()
    return None if found is None else judge_capture_fix(found.version, found.git_version)


NOT_INSTALLED = CaptureFixVerdict(
    False, "no torch_npu", None, f"no torch_npu distribution is installed, so {FIX} cannot be confirmed"
)


#: What still runs where graph variants are refused.
REFUSED_KEEPS = "the eager overlap stays on, and decode graphs capture upstream's serial graph only"


def capture_fix_refusal(backend_name: str) -> str | None:
    """Why decode graph variants may not be captured on ``backend_name``
    (a resolved backend: ``npu``, ``cuda``, ``cpu``), or None: only ``npu``
    is judged, by whether the installed torch_npu has :data:`FIX`."""
    if backend_name != "npu":
        return None
    verdict = installed_capture_fix() or NOT_INSTALLED
    return None if verdict.fixed else f"{GRAPH_VARIANTS_REFUSED}: {verdict.reason}; {REFUSED_KEEPS}"
