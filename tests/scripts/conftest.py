"""The benchmark scripts' tests: one real `fairtick serve` (mixed_step, 5 running, 16-token
chunks) per module, started like the e2e tests start theirs; `benchlib` importable."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from server.trace_png import state_colours
from tests.e2e.conftest import LiveServer, start_server, stop_server

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"

SERVE_FLAGS = ("--policy", "mixed_step", "--max-running", "5", "--prefill-chunk-size", "16")
# A layout small enough for 2 cores: 200-token prompt (13 chunks), half a second of quiet and
# half a second after the prompt's first token.
SMALL = ["--prompt-tokens", "200", "--settle-s", "0.5", "--post-s", "0.5",
         "--stream-tokens", "3000", "--timeout-s", "60"]


@pytest.fixture(scope="module")
def mixed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = start_server(tmp_path_factory.mktemp("scripts"), *SERVE_FLAGS)
    yield server
    stop_server(server)


def run_script(name: str, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """scripts/NAME ARGS with this interpreter, output captured."""
    return subprocess.run([sys.executable, str(SCRIPTS / name), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s)


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR; fails the test if `path` is not a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:16]
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def png_bars(path: Path, min_run_px: int = 3) -> list[list[tuple[str, int]]]:
    """What a `fairtick trace --png` picture shows: its lanes, top to bottom, each as the bars
    it shows from left to right, (state, width in pixels), pieces of one state merged (an axis
    line over a bar cuts it in pieces), read back by colour. The legend (the lowest band: its
    keys are the states drawn, no more and no fewer) is checked and left out; text and axis
    lines are told from bars by their size."""
    import matplotlib.image as mpimg
    import numpy as np

    rgb = (mpimg.imread(str(path))[..., :3] * 255).round().astype(int)
    masks = {state: np.all(rgb == [int(colour[i:i + 2], 16) for i in (1, 3, 5)], axis=-1)
             for state, colour in state_colours().items()}
    coloured = np.any(np.stack(list(masks.values())), axis=0).any(axis=1)
    bands: list[list[int]] = []
    for row in np.flatnonzero(coloured):
        if bands and row == bands[-1][1] + 1:
            bands[-1][1] = row
        else:
            bands.append([row, row])
    lanes = []
    for top, bottom in bands:
        if bottom - top + 1 < min_run_px:
            continue
        middle, bars = (top + bottom) // 2, []
        for state, mask in masks.items():
            row = np.concatenate([[0], mask[middle].astype(int), [0]])
            starts, ends = np.flatnonzero(np.diff(row) == 1), np.flatnonzero(np.diff(row) == -1)
            bars += [(int(x), int(end), state) for x, end in zip(starts, ends, strict=True)
                     if end - x >= min_run_px]
        merged: list[tuple[str, int]] = []
        for x, end, state in sorted(bars):
            if merged and merged[-1][0] == state:
                merged[-1] = (state, merged[-1][1] + end - x)
            else:
                merged.append((state, end - x))
        if merged:
            lanes.append(merged)
    assert lanes, f"nothing drawn in {path}"
    *lanes, legend = lanes
    drawn = {state for lane in lanes for state, _ in lane}
    assert {state for state, _ in legend} == drawn, f"legend {legend} for states {drawn}"
    return lanes


def png_lanes(path: Path, min_run_px: int = 3) -> list[list[str]]:
    """The states of each lane of `png_bars`, left to right."""
    return [[state for state, _ in lane] for lane in png_bars(path, min_run_px)]
