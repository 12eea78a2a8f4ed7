"""The chunk radix cache: passages found by content, grafted, leased at admission, counted."""
