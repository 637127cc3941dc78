"""``nl.NKIObject``: the base class of user classes inside kernels, dataclass-like.

NKI 0.6 documents that every user class used in a kernel inherits from ``NKIObject`` and behaves like a
dataclass whose ``__init__`` (and the call of ``__post_init__``) is synthesized from its annotated
fields (aws-neuron/aws-neuron-sdk @ 81ce03a, ``nki/get-started/nki-language-guide.rst``).  The emulator gives
every subclass that generated ``__init__``: fields are the annotated class attributes of the class and its
``NKIObject`` bases (base fields first, in definition order, ``ClassVar`` excluded); a class attribute is the
field's default (``dataclasses.field(default=/default_factory=)`` too); arguments bind positionally or by
name; a missing field without default or an unknown argument raises ``TypeError``.  A subclass that defines
its own ``__init__`` or is decorated with ``@dataclasses.dataclass`` keeps that one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

_MISSING = dataclasses.MISSING


def _is_classvar(annotation: Any) -> bool:
    if annotation is ClassVar:
        return True
    if isinstance(annotation, str):
        a = annotation.replace("typing.", "")
        return a == "ClassVar" or a.startswith("ClassVar[")
    return getattr(annotation, "__origin__", None) is ClassVar


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
            for name, ann in base.__dict__.get("__annotations__", {}).items():
                if not _is_classvar(ann) and name not in names:
                    names.append(name)
        cls.__nki_fields__ = tuple(names)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
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
        for name in fields:
            if name in kwargs:
                value = kwargs[name]
            else:
                value = _default(cls, name)
                if value is _MISSING:
                    raise TypeError(
                        f"{cls.__name__}() missing a value for field {name!r} (it has no default)"
                    )
            setattr(self, name, value)
        post = getattr(self, "__post_init__", None)
        if post is not None:
            post()

    def __repr__(self) -> str:
        fields = type(self).__nki_fields__
        body = ", ".join(f"{n}={getattr(self, n, '<unset>')!r}" for n in fields)
        return f"{type(self).__name__}({body})"


def _default(cls: type, name: str) -> Any:
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
