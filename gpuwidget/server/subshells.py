"""Kernel subshell requests do not change what the page says the kernel is doing.

JupyterLab 4.6 sends widget comms over a kernel subshell (one per comm target) that it
creates with the first widget comm and deletes with the last. The kernel answers each
``create_subshell_request`` on its control channel with a busy/idle status pair, and the
page shows that "idle" as the kernel's state: the first live plot under a running cell
turned the status bar to "Idle" until the cell ended. jupyter_server has a list of message
types whose statuses are not the kernel's activity (``untracked_message_types``: the page
and the server's own ``execution_state`` skip them); ``debug_request``, the other control
request a page sends while a cell runs, is on it. The subshell requests, newer than that
list, are added here.
"""

from __future__ import annotations

from typing import Any

SUBSHELL_MESSAGE_TYPES = (
    "create_subshell_request",
    "create_subshell_reply",
    "delete_subshell_request",
    "delete_subshell_reply",
    "list_subshell_request",
    "list_subshell_reply",
)


def untrack_subshell_requests(serverapp: Any) -> list[str]:
    """Add the subshell requests to the server's untracked message types (and to the page's copy of them)."""
    manager = serverapp.kernel_manager
    current = list(getattr(manager, "untracked_message_types", None) or [])
    missing = [name for name in SUBSHELL_MESSAGE_TYPES if name not in current]
    if not missing or not hasattr(manager, "untracked_message_types"):
        return []
    manager.untracked_message_types = current + missing
    # JupyterLab copies the list into the page's configuration when it loads; an extension
    # loaded after it would otherwise leave the page with the old list.
    page_config = serverapp.web_app.settings.get("page_config_data")
    if isinstance(page_config, dict) and "untracked_message_types" in page_config:
        page_config["untracked_message_types"] = list(manager.untracked_message_types)
    return missing
