"""The one exception a codec's decode raises on malformed or hostile input."""


class CodecError(ValueError):
    """A blob could not be decoded; the message names the offending field.

    Decoders raise nothing else on bad input, so a receiver can reject a peer's
    payload with a single ``except CodecError``.
    """
