"""The one domain exception. Library code raises it; only the CLI catches it.

Example:
    >>> raise MfggufError("expert index 7 is out of range 1..4; pass --expert between 1 and 4")
"""


class MfggufError(Exception):
    """Bad input or state the user can fix. The message is one line: what is wrong, what to do."""
