"""`picrag bench` (quality, load, calibrate) and `picrag ask`, with the QA scoring they report."""
