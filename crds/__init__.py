"""RolloutJob and trajectory resource definitions (pydantic v2). Imported by every other part."""
