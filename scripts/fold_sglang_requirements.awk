# Filter for pip's stderr during setup. sglang is installed with --no-deps and only the part of
# its requirements that picrag runs is installed, so every later pip call lists each left-out
# requirement as "sglang X requires Y, which is not installed." under the resolver's ERROR
# header. Those lines become one summary line, and the header goes too when no other conflict
# follows it; every other line passes through unchanged, so a real conflict shows as pip wrote it.
/^ERROR: pip's dependency resolver does not currently take into account all the packages that are installed\./ {
  header = $0
  next
}
/^sglang [^ ]+ requires .*, which is not installed\.$/ {
  left_out++
  version = $2
  next
}
header != "" {
  if ($0 ~ /^[^ ]+ [^ ]+ (requires|has requirement) /)
    print header
  header = ""
}
{ print }
END {
  if (left_out)
    printf "[setup] %d requirements of sglang %s are not installed, on purpose: CUDA kernels and features picrag does not use\n", left_out, version
}
