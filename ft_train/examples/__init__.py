"""Example training functions that ship with ft-train."""
