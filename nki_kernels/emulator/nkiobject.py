"""``nl.NKIObject``: the base class of user classes inside kernels, dataclass-like.

NKI 0.6 documents (aws-neuron/aws-neuron-sdk @ 81ce03a, ``nki/get-started/nki-language-guide.rst``, "Class
Support"): every user class used in a kernel inherits from ``NKIObject``; "all classes are similar to Python
data classes"; "the @dataclass decorator is optional; classes with and without the @dataclass decorator will
be compiled in the same way"; the compiler creates ``__init__`` and ``__post_init__`` "if they are not
provided by the user", the default being ``def __init__(self, x = None, y = False)`` for fields ``x: int``,
``y: bool = False`` (a field without a default defaults to ``None``).

So every subclass that does not define ``__init__`` in its own body (nor inherits one a user wrote) gets the
generated ``__init__``, also under ``@dataclasses.dataclass`` (the decorator does not replace an ``__init__``
already in the class, so the generated one stays; a frozen dataclass still freezes the object after it).
Fields are, base classes first: the annotated names (``ClassVar`` excluded) and the plain class attributes
(not functions, descriptors, classes or dunder names; aws-neuron/nki-library's ``attention_cte.py``
constructs ``SectionParams(section_idx=...)`` whose fields are unannotated ``section_idx = None``), in
definition order; a class attribute (or ``dataclasses.field(default=/default_factory=)``) is the default,
else ``None``.  Arguments bind positionally or by name; an unknown name, a repeated one or too many
positional arguments raise ``TypeError`` (as any Python call does).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, ClassVar

_MISSING = dataclasses.MISSING


def _is_classvar(annotation: Any) -> bool:
    if annotation is ClassVar:
        return True
    if isinstance(annotation, str):
        a = annotation.replace("typing.", "")
        return a == "ClassVar" or a.startswith("ClassVar[")
    return getattr(annotation, "__origin__", None) is ClassVar


def _is_plain_attribute(name: str, value: Any) -> bool:
    if name.startswith("__") and name.endswith("__"):
        return False
    if isinstance(value, (staticmethod, classmethod, property, type)) or inspect.isroutine(value):
        return False
    return not hasattr(type(value), "__get__") or isinstance(value, dataclasses.Field)


def _own_fields(cls: type) -> list[str]:
    """``cls``'s own fields in definition order (annotated names and plain class attributes merged)."""
    ann = [n for n, a in cls.__dict__.get("__annotations__", {}).items() if not _is_classvar(a)]
    ann_set = set(ann)
    out: list[str] = []
    pending = list(ann)
    for name, value in cls.__dict__.items():
        if name in ann_set:
            while pending and pending[0] != name:  # annotated names declared before this one, without value
                out.append(pending.pop(0))
            if pending:
                out.append(pending.pop(0))
        elif _is_plain_attribute(name, value) and not _is_classvar(value):
            out.append(name)
    out += pending
    return out


class NKIObject:
    """Base class for user classes inside kernels, with a generated dataclass-like ``__init__`` (see the
    module docstring)."""

    __nki_fields__: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        names: list[str] = []
        for base in reversed(cls.__mro__):
            if base is NKIObject or not issubclass(base, NKIObject):
                continue
            for name in _own_fields(base):
                if name not in names:
                    names.append(name)
        cls.__nki_fields__ = tuple(names)
        # the generated __init__ goes into the class itself unless the user wrote one (here or in a base), so
        # that a later @dataclass keeps it (dataclasses never replace an __init__ already in the class body)
        user_init = any(
            "__init__" in b.__dict__ and not getattr(b.__dict__["__init__"], "_nki_generated", False)
            for b in cls.__mro__
            if b is not NKIObject and issubclass(b, NKIObject)
        )
        if not user_init:
            cls.__init__ = _generated_init  # type: ignore[method-assign]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _generated_init(self, *args, **kwargs)

    def __repr__(self) -> str:
        fields = type(self).__nki_fields__
        body = ", ".join(f"{n}={getattr(self, n, '<unset>')!r}" for n in fields)
        return f"{type(self).__name__}({body})"


def _default(cls: type, name: str) -> Any:
    dc = getattr(cls, "__dataclass_fields__", {}).get(name)
    if dc is not None and dc.default_factory is not _MISSING:  # @dataclass removed the class attribute
        return dc.default_factory()
    for base in cls.__mro__:
        if name in base.__dict__:
            v = base.__dict__[name]
            if isinstance(v, dataclasses.Field):
                if v.default is not _MISSING:
                    return v.default
                if v.default_factory is not _MISSING:
                    return v.default_factory()
                return _MISSING
            return v
    return _MISSING


def _generated_init(self: Any, *args: Any, **kwargs: Any) -> None:
    """The compiler-generated ``__init__`` of an ``NKIObject`` subclass (module docstring)."""
    cls = type(self)
    fields = cls.__nki_fields__
    if len(args) > len(fields):
        raise TypeError(
            f"{cls.__name__}() takes {len(fields)} positional arguments (fields {list(fields)}) but "
            f"{len(args)} were given"
        )
    unknown = [k for k in kwargs if k not in fields]
    if unknown:
        raise TypeError(
            f"{cls.__name__}() got unexpected keyword arguments {unknown}; fields: {list(fields)}"
        )
    for name, value in zip(fields, args):
        if name in kwargs:
            raise TypeError(f"{cls.__name__}() got multiple values for field {name!r}")
        kwargs[name] = value
    params = getattr(cls, "__dataclass_params__", None)
    put = object.__setattr__ if params is not None and params.frozen else setattr
    for name in fields:
        if name in kwargs:
            value = kwargs[name]
        else:
            value = _default(cls, name)
            if value is _MISSING:
                value = None  # NKI 0.6: a field without a default defaults to None
        put(self, name, value)
    post = getattr(self, "__post_init__", None)
    if post is not None:
        post()


_generated_init._nki_generated = True  # type: ignore[attr-defined]
