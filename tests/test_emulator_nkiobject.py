"""``nl.NKIObject`` as NKI 0.6 documents it (language guide, "Class Support"; docs/emulator.md):

* the ``@dataclass`` decorator is optional and changes nothing: the generated ``__init__`` is the same with or
  without it (the nki-library ``attention_cte`` pattern: ``@dataclass class SectionParams(nl.NKIObject)`` with
  unannotated ``section_idx = None`` attributes, built as ``SectionParams(section_idx=...)``);
* a field without a default defaults to ``None`` (``def __init__(self, x = None, y = False)``);
* a user ``__init__`` (in the class or a base) is kept; ``__post_init__`` runs after the generated one;
* what a Python call refuses is still refused: unknown names, repeated names, too many positional arguments.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest

from nki_kernels.emulator import isa as nisa
from nki_kernels.emulator import language as nl
from nki_kernels.emulator import run

pytestmark = pytest.mark.emulator


@dataclass
class Section(nl.NKIObject):
    index = None  # unannotated: still a field of the generated __init__
    offset = 0
    active: bool = None


class SectionPlain(nl.NKIObject):
    index = None
    offset = 0
    active: bool = None


@dataclass
class WithFactory(nl.NKIObject):
    rows: int
    tags: list = dataclasses.field(default_factory=list)

    def double(self):
        return 2 * self.rows


class Parent(nl.NKIObject):
    x: int

    def __init__(self, v):
        self.x = v + 100


class Child(Parent):
    y: int = 5


def test_dataclass_decorator_is_optional_and_unannotated_attributes_are_fields():
    for cls in (Section, SectionPlain):
        s = cls(index=3, offset=512, active=True)
        assert (s.index, s.offset, s.active) == (3, 512, True)
        t = cls(7)
        assert (t.index, t.offset, t.active) == (7, 0, None)
        assert cls.__nki_fields__ == ("index", "offset", "active")
    assert Section(1, 2, False) == Section(index=1, offset=2, active=False)  # @dataclass's structural __eq__


def test_missing_field_defaults_to_none_and_factory_defaults_are_fresh():
    w, v = WithFactory(), WithFactory(rows=4)
    assert w.rows is None and w.tags == [] and v.tags == [] and v.tags is not w.tags
    assert v.double() == 8


def test_user_init_is_kept_also_when_inherited():
    assert Parent(1).x == 101
    c = Child(2)
    assert c.x == 102 and c.y == 5  # Child inherits Parent's user __init__, as in Python


def test_calls_python_refuses_stay_refused():
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['section_idx'\]"):
        Section(section_idx=1)
    with pytest.raises(TypeError, match="multiple values for field 'index'"):
        Section(1, index=2)
    with pytest.raises(TypeError, match="takes 3 positional arguments"):
        Section(1, 2, 3, 4)


def _kernel_with_objects(x):
    """x: HBM [128, 64] fp32 -> x * (section.index + section.offset), the object built inside the kernel."""
    sp = Section(index=2, offset=3)
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(t, x)
    nisa.tensor_scalar(t, t, nl.multiply, float(sp.index + sp.offset))
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(out, t)
    return out


def test_kernel_constructs_objects():
    x = np.random.default_rng(0).standard_normal((128, 64)).astype(np.float32)
    out, _ = run(_kernel_with_objects, x)
    np.testing.assert_array_equal(out, x * np.float32(5.0))
