"""The SDK's rooms (issue 36): each file one idea and at most 600 lines, no import circle between them, Dagster's
public API only, and the names a user imports from ``envloop_pipelines.sdk`` each defined in one of them."""

from __future__ import annotations

from pathlib import Path

import envloop_pipelines.sdk as sdk
from envloop_pipelines_tests.test_import_direction import PACKAGE_ROOT, cycles, imported_modules

SDK = PACKAGE_ROOT / "sdk"
#: Longer than this, a file holds more than one idea (client.py was 1,040 lines, local.py 821).
MAX_LINES = 600


def test_no_file_of_the_sdk_is_over_600_lines() -> None:
    lines = {p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in sorted(SDK.glob("*.py"))}
    long = {name: n for name, n in lines.items() if n > MAX_LINES}
    assert long == {}, f"split these by idea: {long}"


def test_no_import_circle_between_the_sdks_and_resources_files() -> None:
    edges: dict[tuple[str, str], str] = {}
    for folder in (SDK, PACKAGE_ROOT / "resources"):
        for path in sorted(folder.glob("*.py")):
            if path.name == "__init__.py":  # the package's exports import every room; the rooms import rooms
                continue
            own = f"envloop_pipelines.{folder.name}.{path.stem}"
            for line, name in imported_modules(path):
                if name.count(".") == 2 and name.split(".")[1] in ("sdk", "resources") and name != own:
                    edges.setdefault((own, name), f"{path.name}:{line}")
    assert edges, "the parser found no import between the rooms"
    assert cycles(edges) == []


def test_the_package_imports_no_private_dagster_module() -> None:
    private = [f"{path.relative_to(PACKAGE_ROOT)}:{line}: {name}" for path in sorted(PACKAGE_ROOT.rglob("*.py"))
               for line, name in imported_modules(path) if name.startswith("dagster._")]
    assert private == []


def test_each_exported_name_is_defined_in_a_room_of_the_sdk() -> None:
    homes = {name: getattr(sdk, name).__module__ for name in sdk.__all__}
    assert all(home.startswith("envloop_pipelines.sdk.") for home in homes.values()), homes
    assert {homes["Client"], homes["LocalClient"], homes["RoundFailed"], homes["RunInfo"]} == {
        "envloop_pipelines.sdk.client", "envloop_pipelines.sdk.local", "envloop_pipelines.sdk.errors",
        "envloop_pipelines.sdk.records"}
    assert Path(sdk.__file__).parent == SDK
