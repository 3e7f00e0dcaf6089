#!/usr/bin/env bash
# Fetch text for a broader distillation corpus from the package registries and unpack it under DIR:
# DIR/debian (documentation packages: prose, SQL and code examples) and DIR/npm (JavaScript/TypeScript sources
# and READMEs). Then build the corpus from it and this machine's own sources:
#   scripts/corpus_packages.sh pkgtext
#   specdec corpus --source pkgtext/debian:prose --source pkgtext/npm --mb 64 --out corpus.jsonl
# Needs apt-get (Debian/Ubuntu) and npm. Nothing here is a benchmark; `specdec corpus` leaves out any text
# that shares a 13-word run with one of specdec's benchmark prompts.
set -euo pipefail
dir=${1:?usage: corpus_packages.sh DIR}
debian=(python3.11-doc debian-reference-en postgresql-doc-15 sqlite3-doc git-doc)
npm=(lodash express axios commander yargs rxjs zod date-fns moment knex sequelize typeorm)
mkdir -p "$dir/debian" "$dir/npm" "$dir/.download"
cd "$dir/.download"
apt-get download "${debian[@]}" >/dev/null 2>&1
for deb in *.deb; do dpkg-deb -x "$deb" ../debian; done
npm pack --silent "${npm[@]}" >/dev/null
for tgz in *.tgz; do mkdir -p "../npm/${tgz%.tgz}" && tar xzf "$tgz" -C "../npm/${tgz%.tgz}"; done
cd .. && rm -rf .download
du -sh debian npm
