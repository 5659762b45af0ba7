"""Pieces every tinkerflow process shares: settings, the claim-check store, logging."""
