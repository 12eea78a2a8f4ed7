"""`picrag bench` (quality, load) and `picrag ask`, with the QA scoring they report."""
