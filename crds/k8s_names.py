"""Kubernetes' rules for names and labels: DNS-1123 labels, label keys and values, checked without pydantic.

Used by the resource models (rolloutjob.py, executor.py) and the controller's selectors and discovery.
"""
from __future__ import annotations

import re
import secrets

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


# Kubernetes' own generator (apiserver's names.SimpleNameGenerator): a prefix of at most 58 characters and five of
# these, so that a generated name is at most 63 and has no vowel to spell a word
GENERATED_PREFIX_MAX = 58
_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
ANNOTATIONS_MAX_BYTES = 256 * 1024  # Kubernetes' TotalAnnotationSizeLimitB: keys and values together


def generated_name(prefix: str) -> str:
    """`metadata.generateName` made into a name, as Kubernetes makes it (a longer prefix is cut to 58)."""
    return prefix[:GENERATED_PREFIX_MAX] + "".join(secrets.choice(_SUFFIX_ALPHABET) for _ in range(5))


def validate_name_prefix(prefix: str) -> str:
    if not prefix or not re.fullmatch(r"[a-z0-9][-a-z0-9]*", prefix):
        raise ValueError("must be the start of a DNS-1123 label: lowercase letters, digits and '-', starting with a "
                         "letter or digit (e.g. 'sweep-')")
    return prefix


def validate_annotations(annotations: dict[str, str]) -> dict[str, str]:
    """At most Kubernetes' total size. Keys are not checked as Kubernetes checks them: a job stored with another key
    by an earlier version would no longer load."""
    size = sum(len(key.encode()) + len(value.encode()) for key, value in annotations.items())
    if size > ANNOTATIONS_MAX_BYTES:
        raise ValueError(f"annotations take {size} bytes: at most {ANNOTATIONS_MAX_BYTES} (Kubernetes' limit)")
    return annotations
