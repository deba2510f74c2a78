"""Helpers shared by the test tiers (unit/, dist/, integration/)."""
