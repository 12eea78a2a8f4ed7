"""`picrag bench` (quality, load, calibrate, frontier) and `picrag ask`, with the QA scoring they report."""
