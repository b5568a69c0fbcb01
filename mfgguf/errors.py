"""The one domain exception. Library code raises it; only the CLI catches it.

Example:
    >>> raise MfggufError("expert index 7 is out of range 1..4; pass --expert between 1 and 4")
"""


class MfggufError(Exception):
    """Bad input or state the user can fix. The message is one line: what is wrong, what to do."""


class Outdated(MfggufError):
    """A file an earlier mfgguf wrote in a format this one no longer reads (a module of format 1, a GGUF of mfgguf
    0.1), refused where it is first read: the message names the version that wrote it and what to run again."""


RETIRED_AT = "2a0bd6e"  # the last commit that still runs the options the studies measured not to pay


def retired(what: str, option: str, fix: str) -> MfggufError:
    """The refusal of a file or RUN that only a removed option could continue (docs/studies.md lists them).

    Example:
        >>> str(retired("expert_001 was trained", "--complement", "retrain it without it"))[:52]
        'expert_001 was trained with --complement, which mfgg'
    """
    return MfggufError(f"{what} with {option}, which mfgguf removed (measured not to pay: docs/studies.md); {fix},"
                       f" or use mfgguf at commit {RETIRED_AT}")
