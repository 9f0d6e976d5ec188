"""Window geometry: exact reference parity on the golden list, and properties on generated grids."""

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import winsp
from winsp.geometry.layout import build_layout
from winsp.geometry.windows import FixedWindows, SeedVR2Windows, make_geometry, window_slices

GOLDEN = Path(__file__).parent / "golden" / "windows_reference.jsonl.gz"


def _as_lists(slices):
    return [[t.start, t.stop, h.start, h.stop, w.start, w.stop] for t, h, w in slices]


def test_every_golden_line_is_reproduced_exactly():
    lines = [json.loads(line) for line in gzip.open(GOLDEN, "rt")]
    assert len(lines) == 3260
    methods = {d["method"] for d in lines}
    assert methods == {"720pwin_by_size_bysize", "720pswin_by_size_bysize"}
    mismatches = [
        (d["method"], d["size"], d["num_windows"])
        for d in lines
        if _as_lists(window_slices(d["size"], d["num_windows"], d["method"])) != d["windows"]
    ]
    assert mismatches == []


def test_short_method_names_are_the_same_geometry():
    assert window_slices((12, 45, 80), (4, 3, 3), "regular") == window_slices((12, 45, 80), (4, 3, 3), winsp.geometry.REGULAR_METHOD)
    assert window_slices((12, 45, 80), (4, 3, 3), "shifted") == window_slices((12, 45, 80), (4, 3, 3), winsp.geometry.SHIFTED_METHOD)


grids = st.tuples(st.integers(1, 40), st.integers(1, 90), st.integers(1, 90))
counts = st.tuples(st.integers(1, 6), st.integers(1, 6), st.integers(1, 6))


def _assert_partition(grid, slices):
    t, h, w = grid
    cover = np.zeros(grid, dtype=np.int64)
    for st_, sh, sw in slices:
        assert 0 <= st_.start < st_.stop <= t and 0 <= sh.start < sh.stop <= h and 0 <= sw.start < sw.stop <= w
        cover[st_, sh, sw] += 1
    assert (cover == 1).all()


def _assert_enumeration_order(slices):
    keys = [(sw.start, sh.start, st_.start) for st_, sh, sw in slices]  # w outermost, then h, t innermost
    assert keys == sorted(keys)


@settings(max_examples=150, deadline=None)
@given(grid=grids, num=counts, shifted=st.booleans())
def test_seedvr2_windows_partition_the_grid_in_reference_order(grid, num, shifted):
    geom = SeedVR2Windows(num, shifted=shifted)
    slices = geom.slices(grid)
    _assert_partition(grid, slices)
    _assert_enumeration_order(slices)
    wt, wh, ww = geom.window_size(grid)
    assert wt == math.ceil(min(grid[0], 30) / num[0])
    for st_, sh, sw in slices:  # no window is larger than the nominal window size
        assert st_.stop - st_.start <= wt and sh.stop - sh.start <= wh and sw.stop - sw.start <= ww


@settings(max_examples=40, deadline=None)
@given(grid=grids, win=st.tuples(st.integers(1, 8), st.integers(1, 8), st.integers(1, 8)), data=st.data())
def test_fixed_windows_partition_the_grid(grid, win, data):
    shift = tuple(data.draw(st.integers(0, k - 1)) for k in win)
    slices = FixedWindows(win, shift=shift).slices(grid)
    _assert_partition(grid, slices)
    _assert_enumeration_order(slices)


def test_shifted_is_not_a_cyclic_roll_and_differs_from_regular():
    regular = window_slices((12, 45, 80), (4, 3, 3), "regular")
    shifted = window_slices((12, 45, 80), (4, 3, 3), "shifted")
    assert len(regular) == 36 and len(shifted) == 80
    # the first shifted window is clipped at the origin (half a window), not wrapped around
    t, h, w = shifted[0]
    assert (t.start, h.start, w.start) == (0, 0, 0) and (t.stop, h.stop, w.stop) == (1, 7, 13)


@pytest.mark.parametrize("bad, message", [
    (dict(grid=(0, 4, 4), num_windows=(1, 1, 1), method="regular"), "grid\\[t\\]"),
    (dict(grid=(4, 4), num_windows=(1, 1, 1), method="regular"), "grid"),
    (dict(grid=(4, 4.0, 4), num_windows=(1, 1, 1), method="regular"), "grid\\[h\\]"),
    (dict(grid=(4, 4, 4), num_windows=(1, 0, 1), method="regular"), "num_windows\\[h\\]"),
    (dict(grid=(4, 4, 4), num_windows=(1, 1, 1), method="diagonal"), "method"),
])
def test_invalid_arguments_name_the_argument(bad, message):
    with pytest.raises(ValueError, match=message):
        window_slices(**bad)


def test_fingerprints_are_stable_and_sensitive():
    a = make_geometry("regular", (4, 3, 3))
    assert a.fingerprint == make_geometry("720pwin_by_size_bysize", (4, 3, 3)).fingerprint
    assert len(a.fingerprint) == 40
    others = [make_geometry("shifted", (4, 3, 3)), make_geometry("regular", (4, 3, 2)), FixedWindows((4, 3, 3))]
    assert len({a.fingerprint, *(g.fingerprint for g in others)}) == 4

    class Bumped(SeedVR2Windows):
        version = 2

    assert Bumped((4, 3, 3)).fingerprint != a.fingerprint


def _reference_window_ids(grids, geom):
    """Window a canonical arange tensor, as the reference does, and read the ids back."""
    out, offset = [], 0
    for grid in grids:
        ids = torch.arange(offset, offset + math.prod(grid)).reshape(grid)
        out += [ids[s].reshape(-1) for s in geom.slices(grid)]
        offset += math.prod(grid)
    return torch.cat(out).numpy()


@settings(max_examples=40, deadline=None)
@given(batch=st.lists(grids, min_size=1, max_size=3), num=counts, shifted=st.booleans())
def test_layout_token_ids_counts_and_coords(batch, num, shifted):
    geom = SeedVR2Windows(num, shifted=shifted)
    lay = build_layout(batch, geom)
    assert np.array_equal(lay.token_ids, _reference_window_ids(batch, geom))
    assert lay.token_counts.sum() == sum(math.prod(g) for g in batch)
    assert np.array_equal(np.diff(lay.offsets), lay.token_counts)
    for w in range(lay.num_windows):
        dt, dh, dw = lay.window_shape[w]
        coords = lay.window_coords[lay.offsets[w]:lay.offsets[w + 1]]
        expected = np.stack(np.meshgrid(np.arange(dt), np.arange(dh), np.arange(dw), indexing="ij"), -1).reshape(-1, 3)
        assert np.array_equal(coords, expected)
    assert np.array_equal(lay.windows_per_sample, [len(geom.slices(g)) for g in batch])


def test_layout_rejects_bad_grids_and_geometries():
    geom = make_geometry("regular", (4, 3, 3))
    with pytest.raises(ValueError, match="single grid"):
        build_layout((4, 4, 4), geom)
    with pytest.raises(ValueError, match="grids\\[1\\]\\[w\\]"):
        build_layout([(4, 4, 4), (4, 4, 0)], geom)
    with pytest.raises(ValueError, match="WindowGeometry"):
        build_layout([(4, 4, 4)], "regular")

    class Overlapping(FixedWindows):
        def slices(self, grid):
            return [(slice(0, grid[0]), slice(0, grid[1]), slice(0, grid[2]))] * 2

    with pytest.raises(ValueError, match="partition"):
        build_layout([(2, 2, 2)], Overlapping((1, 1, 1)))


@pytest.mark.parametrize("method", ["regular", "shifted"])
def test_too_elongated_grids_raise_a_value_error_naming_the_limit(method):
    with pytest.raises(ValueError, match="rounds to 0 tokens.*14400:1"):
        winsp.geometry.window_slices((1, 1, 14401), (1, 3, 3), method)
    with pytest.raises(ValueError, match="window width rounds to 0"):
        winsp.geometry.window_slices((1, 14401, 1), (1, 3, 3), method)
    assert len(winsp.geometry.window_slices((1, 1, 14399), (1, 3, 3), method)) >= 1


def test_geometries_whose_boxes_leave_the_grid_are_refused():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Overhanging(winsp.WindowGeometry):
        def slices(self, grid):
            t, h, w = grid
            # two boxes that, clipped to the grid, would tile it exactly; the second reaches past the edge
            return [(slice(0, t), slice(0, h), slice(0, w // 2)), (slice(0, t), slice(0, h), slice(w // 2, w + 3))]

    with pytest.raises(ValueError, match="w-slice slice\\(4, 11, None\\).*inside \\[0, 8\\)"):
        winsp.geometry.build_layout([(2, 3, 8)], Overhanging())

    @dataclass(frozen=True)
    class Negative(winsp.WindowGeometry):
        def slices(self, grid):
            t, h, w = grid
            return [(slice(-1, t), slice(0, h), slice(0, w))]

    with pytest.raises(ValueError, match="t-slice"):
        winsp.geometry.build_layout([(2, 3, 8)], Negative())
