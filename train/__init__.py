"""Drafter training: regenerated data, stored target features, the fit loop and evaluation."""
