"""Kubernetes' rules for names and labels: DNS-1123 labels, label keys and values, checked without pydantic.

Used by the resource models (rolloutjob.py, executor.py) and the controller's selectors and discovery.
"""
from __future__ import annotations

import re

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def valid_label_key(key: str) -> bool:
    return len(key) <= 253 and _LABEL_KEY.match(key) is not None


def valid_label_value(value: str) -> bool:
    return len(value) <= 63 and _LABEL_VALUE.match(value) is not None


def validate_name(name: str) -> str:
    if len(name) > 63 or not DNS1123_LABEL.match(name):
        raise ValueError(
            "must be a DNS-1123 label: at most 63 characters, lowercase letters, digits and '-', "
            "starting and ending with a letter or digit (e.g. 'math-demo')"
        )
    return name
