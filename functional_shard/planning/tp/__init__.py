"""Tensor parallel: rule sets, torch's styles, Hugging Face's plans, rules from structure, splits."""
