"""Validation of identifiers that cross the API boundary (user ids, request ids).

User ids name on-disk adapter folders (`<state>/adapters/<user_id>/`), so they must be safe path
components: 1-64 characters of letters, digits, '_', '-', '.', '@', not starting with '.'; a
user of an app other than the daemon's default one is stored as `<app>~<user>` (docs/security.md).
"""

from __future__ import annotations

import re

from edge_runtime.errors import BadRequest

_USER_ID = re.compile(r"^(?:[a-z0-9][a-z0-9_-]{0,31}~)?[A-Za-z0-9_@-][A-Za-z0-9_.@-]{0,63}$")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9_.:@-]{1,128}$")


def validate_user_id(user_id: object) -> str:
    if not isinstance(user_id, str) or not _USER_ID.fullmatch(user_id):
        raise BadRequest(
            "user id must be 1-64 characters of letters, digits, '_', '-', '.', '@' "
            f"and must not start with '.'; got {user_id!r}"
        )
    return user_id


def validate_request_id(request_id: object) -> str:
    if not isinstance(request_id, str) or not _REQUEST_ID.fullmatch(request_id):
        raise BadRequest(
            f"request id must be 1-128 characters of letters, digits, '_', '-', '.', ':', '@'; got {request_id!r}"
        )
    return request_id
