"""Exception types. Every kvbridge error is a ``KVBridgeError`` with a one-line message."""


class KVBridgeError(Exception):
    """Base class of all kvbridge errors."""


class LayoutError(KVBridgeError, ValueError):
    """Unknown layout, bad page size, or pages whose shape or dtype do not fit the layout."""


class InputError(KVBridgeError, ValueError):
    """Bad tensor input: wrong shape, dtype, device or scale."""


class OutputBufferError(InputError):
    """An ``out=`` tensor that cannot receive the result (dtype, shape, device, strides, requires_grad,
    or memory shared with the input); the message names the tensor to pass instead. Nothing was written."""


class NonFiniteError(InputError):
    """NaN or Inf in an encoder's input."""


class CopyMismatchError(InputError):
    """A record whose two copies of some dims (a layout's mirror field and the field it mirrors) disagree:
    its writer would have written them from the same values, so the record is corrupt or foreign."""


class DumpFormatError(KVBridgeError, ValueError):
    """A dump file that is truncated, foreign, or inconsistent with its own metadata."""


class DumpHeaderError(DumpFormatError):
    """A dump header that fails its integrity check: a version-3 header whose ``header_crc32`` does not
    match its bytes (edited or damaged after writing), or a header cut short by truncation."""


class DumpWriteError(KVBridgeError, OSError):
    """A dump could not be written (no permission, no space, output exists or is being written)."""
