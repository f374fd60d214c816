from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_KIND_UNSPECIFIED: _ClassVar[KVKind]
    COMPRESSED: _ClassVar[KVKind]
    FULL: _ClassVar[KVKind]
KV_KIND_UNSPECIFIED: KVKind
COMPRESSED: KVKind
FULL: KVKind

class FetchRequest(_message.Message):
    __slots__ = ("prefix_id", "kind", "background")
    PREFIX_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BACKGROUND_FIELD_NUMBER: _ClassVar[int]
    prefix_id: str
    kind: KVKind
    background: bool
    def __init__(self, prefix_id: _Optional[str] = ..., kind: _Optional[_Union[KVKind, str]] = ..., background: bool = ...) -> None: ...

class KVPiece(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...
