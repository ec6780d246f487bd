"""The one plan record (core/plan.py): what its planners and transports rely on."""

from __future__ import annotations

import numpy as np
import pytest

from mooncake_kvaddr.core.plan import KeyPlan, SlotPlan
from mooncake_kvaddr.driver.staging import plan_slots


def _arrays() -> KeyPlan:
    addrs = np.array([[10, 20], [30, 40], [50, 60]], np.int64)
    sizes = np.array([[1, 2], [3, 4], [5, 6]], np.int64)
    return KeyPlan(["a", "b", "c"], addrs, sizes, np.array([7, 8, 9], np.int64), slots=plan_slots(sizes))


def test_a_plan_unpacks_indexes_and_compares_like_the_four_field_record() -> None:
    plan = KeyPlan(["a"], [[1, 2]], [[3, 4]], [5])
    keys, addrs, sizes, ids = plan
    assert (keys, addrs, sizes, ids) == (["a"], [[1, 2]], [[3, 4]], [5]) == tuple(plan)
    assert plan[1:] == ([[1, 2]], [[3, 4]], [5]) and plan[0] == ["a"]
    assert plan == KeyPlan(["a"], [[1, 2]], [[3, 4]], [5])
    assert plan != KeyPlan(["a"], [[1, 2]], [[3, 5]], [5])
    assert plan != KeyPlan(["a"], [[1, 2]], [[3, 4]], [5], slots=plan_slots(np.array([[3, 4]], np.int64)))
    assert not plan.arrays and _arrays().arrays
    with pytest.raises(TypeError):
        hash(plan)


def test_a_plan_measures_four_fields_whatever_it_holds() -> None:
    """``len(plan)`` is 4 (keys, addrs, sizes, block_ids), as ``tuple(plan)``, with or without slots and widths,
    and whatever the key count."""
    for plan in (KeyPlan([], [], [], []), KeyPlan(["a"], [[1]], [[2]], [3]), _arrays()):
        assert len(plan) == 4 == len(tuple(plan))


def test_slots_and_replace() -> None:
    plan = _arrays()
    assert plan.offsets.tolist() == [0, 64, 128] and plan.object_sizes.tolist() == [3, 7, 11]
    assert plan.total_bytes == 128 + 11 and plan.num_bytes() == 21 and plan.key_bytes() == [3, 7, 11]
    moved = plan._replace(offsets=plan.offsets + 64)
    assert moved.offsets.tolist() == [64, 128, 192] and plan.offsets.tolist() == [0, 64, 128]
    assert moved.keys is plan.keys and moved.total_bytes == plan.total_bytes
    assert plan._replace(keys=["x", "y", "z"]).keys == ["x", "y", "z"]
    with pytest.raises(ValueError, match="no field"):
        plan._replace(bogus=1)
    bare = KeyPlan(["a"], [[1]], [[2]], [0])
    with pytest.raises(AttributeError, match="no staging slots"):
        _ = bare.offsets
    assert bare.key_bytes() == [2] and bare.num_bytes() == 2


def test_part_take_and_lists_keep_keys_rows_and_ids_aligned() -> None:
    plan = _arrays()
    part = plan.part(1, 3)
    assert part.keys == ["b", "c"] and part.addrs.tolist() == [[30, 40], [50, 60]]
    assert part.block_ids.tolist() == [8, 9] and part.sizes.tolist() == [[3, 4], [5, 6]]
    taken = plan.take([2, 0])
    assert taken.keys == ["c", "a"] and taken.block_id_list() == [9, 7] and taken.sizes.tolist() == [[5, 6], [1, 2]]
    lists = KeyPlan(["a", "b"], [[1], [2]], [[3], [4]], [5, 6]).take([1])
    assert tuple(lists) == (["b"], [[2]], [[4]], [6])
    hybrid = KeyPlan(["a", "b"], plan.addrs[:2], plan.sizes[:2], plan.block_ids[:2], widths=np.array([1, 2]))
    assert hybrid.row_lists() == ([[10], [30, 40]], [[1], [3, 4]])
    assert hybrid.take([1]).widths.tolist() == [2] and hybrid.part(0, 1).widths.tolist() == [1]


def test_block_id_lists_are_python_ints_for_either_kind_of_plan() -> None:
    """``block_id_list`` (all ids, or those at ``indices`` in that order) gives a list of Python ints for array
    and list plans alike; ``repr`` names the kind, the key count and whether slots are planned."""
    arrays, lists = _arrays(), KeyPlan(["a", "b"], [[1], [2]], [[3], [4]], [5, 6])
    for plan, every, picked in ((arrays, [7, 8, 9], [9, 7]), (lists, [5, 6], [6, 5])):
        indices = [len(every) - 1, 0]
        for got, want in ((plan.block_id_list(), every), (plan.block_id_list(indices), picked)):
            assert got == want and type(got) is list and {type(v) for v in got} == {int}
    assert repr(arrays) == "KeyPlan(3 keys, arrays, slots=True)"
    assert repr(lists) == "KeyPlan(2 keys, lists, slots=False)"


def test_byte_counts_stay_exact_past_int64() -> None:
    big = np.array([[2**62, 2**62], [1, 2]], np.int64)
    plan = KeyPlan(["a", "b"], np.zeros_like(big), big, np.array([0, 1], np.int64))
    assert plan.key_bytes() == [2**63, 3] and plan.num_bytes() == 2**63 + 3
    assert KeyPlan([], np.zeros((0, 2), np.int64), np.zeros((0, 2), np.int64), np.zeros(0, np.int64)).num_bytes() == 0
    assert SlotPlan(np.zeros(0, np.int64), np.zeros(0, np.int64), 0).total_bytes == 0
