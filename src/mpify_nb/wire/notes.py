"""What a rank's error says besides its message: its notes (``exc.add_note``), and what to do
for the mistakes whose torch message does not say it (a second default group); its message even
when its own ``__str__`` raises (``safe_str``, also wire.errors').

``RemoteFailure.capture`` (errors.py) adds the hint and shows the notes after the message, as
Python does; rank/own_group.py adds a Session's own.
"""

from __future__ import annotations


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` (Python 3.11), on any Python: shown after the exception's message,
    here as by Python itself."""
    notes = getattr(exc, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
        try:
            exc.__notes__ = notes  # type: ignore[attr-defined]
        except Exception:
            return
    if note not in notes:
        notes.append(note)


#: (words of an error, what to do): added to the error a rank reports.
HINTS = (
    ("trying to initialize the default process group twice",
     "This rank has its default process group already: ctx=in_torchddp() (or %%ranch --ddp) made it, or an "
     "earlier init_process_group. A function that makes its own group needs no ctx=in_torchddp() (nor --ddp): "
     "drop it; or call dist.destroy_process_group() before making another."),
)


def with_hint(exc: BaseException) -> None:
    """Add what to do to ``exc`` when its message is one of :data:`HINTS`."""
    text = safe_str(exc)
    for words, hint in HINTS:
        if words in text:
            add_note(exc, hint)


def with_notes(exc: BaseException) -> str:
    """The message of ``exc`` followed by its notes, one a line, as Python shows them."""
    found = getattr(exc, "__notes__", None)
    extra = "".join(f"\n{n}" for n in found if isinstance(n, str)) if isinstance(found, list) else ""
    return safe_str(exc) + extra


def safe_str(exc: BaseException) -> str:
    """``str(exc)``, even when the exception's own ``__str__`` raises: the error being
    reported matters more than its message."""
    try:
        return str(exc)
    except Exception as e:
        try:
            why = f"{type(e).__name__}: {e}"
        except Exception:
            why = type(e).__name__
        return f"<str() of this {type(exc).__name__} raised {why}>"
