"""xpu top: the Textual dashboard of xpud (import name ``xpu_tui``).

Only ``app`` and the widget modules import Textual; the data side (``hoststate``, ``hostrow``,
``topogroups``, ``mailbox``, ``source``, ``render``) does not, so it can be tested and reused on its own.
"""
