//! Problems found in a file, and the machinery that finds them all in one pass.
//!
//! Why this exists: a cluster builder edits topology, model and placement files by hand, and a
//! validator that stops at the first mistake makes them run it once per typo. Every file reader
//! in this crate therefore follows the same three steps, each of which collects [`Problem`]s
//! instead of returning early:
//!
//! 1. parse the TOML text into a spanned document (a syntax error stops here, with line:column);
//! 2. walk the document against a `Schema` and report every unknown key, with the nearest
//!    valid key suggested; the schema's key lists come from the raw serde structs themselves
//!    (`fields_of`), so they cannot drift from what the deserializer accepts;
//! 3. deserialize into raw structs whose fields are all optional and loosely typed (a type error
//!    here is first-only, as serde reports it, but carries line:column and the item it is in),
//!    then validate into typed structs, reporting every semantic problem with the item it names
//!    and what to change.

use serde::Deserialize;
use serde::de::{self, Visitor};
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use toml::Spanned;
use toml::de::{DeTable, DeValue};

/// A 1-based line and column (in characters) in a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Location {
    line: usize,
    column: usize,
}

impl Location {
    /// The location of byte `offset` in `text` (clamped to the end of the text).
    pub fn of_offset(text: &str, offset: usize) -> Location {
        let mut offset = offset.min(text.len());
        while !text.is_char_boundary(offset) {
            offset -= 1;
        }
        let before = &text[..offset];
        let line = before.matches('\n').count() + 1;
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        let column = before[line_start..].chars().count() + 1;
        Location { line, column }
    }

    /// 1-based line.
    pub fn line(&self) -> usize {
        self.line
    }

    /// 1-based column, counted in characters.
    pub fn column(&self) -> usize {
        self.column
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.line, self.column)
    }
}

/// One problem in a file: where (when known), which item, and what is wrong and what to change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    location: Option<Location>,
    item: String,
    message: String,
}

impl Problem {
    /// A problem about `item` (e.g. `node "n0" device "gpu1"`), optionally located in the file.
    pub fn new(
        location: Option<Location>,
        item: impl Into<String>,
        message: impl Into<String>,
    ) -> Problem {
        Problem {
            location,
            item: item.into(),
            message: message.into(),
        }
    }

    /// Where in the file, when the problem is tied to one place.
    pub fn location(&self) -> Option<Location> {
        self.location
    }

    /// The item the problem is about (`node "n0"`, `layer 3`, `top level`, ...).
    pub fn item(&self) -> &str {
        &self.item
    }

    /// What is wrong and what to change.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(loc) = self.location {
            write!(f, "{loc}: ")?;
        }
        if self.item.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.item, self.message)
        }
    }
}

/// Reading a file failed: it could not be read (I/O), or it was read and is invalid.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The file could not be read (missing, permissions, not UTF-8).
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The file was read and has problems; every one is listed.
    #[error("{}", render_problems(path, problems))]
    Invalid {
        /// The file.
        path: PathBuf,
        /// Every problem found, in file order where located.
        problems: Vec<Problem>,
    },
}

impl FileError {
    /// The problems, when the file was invalid (empty for an I/O error).
    pub fn problems(&self) -> &[Problem] {
        match self {
            FileError::Io { .. } => &[],
            FileError::Invalid { problems, .. } => problems,
        }
    }

    /// True when the file could not be read at all (exit code 2 in the CLI).
    pub fn is_io(&self) -> bool {
        matches!(self, FileError::Io { .. })
    }
}

/// Problems of one kind shown before the rest are summed up in one line ([`render_problems`]).
pub const SHOWN_PER_KIND: usize = 10;

/// One line per problem, each prefixed with `path:` (and `line:column:` when located). Past
/// [`SHOWN_PER_KIND`] problems of one kind (the same message but for names and numbers), the
/// rest of that kind is one line: `... and 41,000 more like this`.
pub fn render_problems(path: &Path, problems: &[Problem]) -> String {
    let kinds: Vec<String> = problems.iter().map(|p| problem_kind(&p.message)).collect();
    let mut totals: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for k in &kinds {
        *totals.entry(k.as_str()).or_default() += 1;
    }
    let mut seen: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    let mut lines: Vec<String> = Vec::new();
    for (p, k) in problems.iter().zip(&kinds) {
        let n = seen.entry(k.as_str()).or_default();
        *n += 1;
        if *n > SHOWN_PER_KIND {
            continue;
        }
        lines.push(match p.location {
            Some(_) => format!("{}:{p}", path.display()),
            None => format!("{}: {p}", path.display()),
        });
        let total = totals[k.as_str()];
        if *n == SHOWN_PER_KIND && total > SHOWN_PER_KIND {
            lines.push(format!(
                "{}: ... and {} more like this",
                path.display(),
                thousands(total - SHOWN_PER_KIND)
            ));
        }
    }
    lines.join("\n")
}

/// A message with its quoted names and its numbers blanked out: problems of one kind share it.
fn problem_kind(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut quoted = false;
    let mut last_digit = false;
    for c in message.chars() {
        if c == '"' {
            quoted = !quoted;
            out.push(c);
        } else if quoted {
            continue;
        } else if c.is_ascii_digit() {
            if !last_digit {
                out.push('#');
            }
        } else {
            out.push(c);
        }
        last_digit = c.is_ascii_digit();
    }
    out
}

/// `41875` as `41,875`.
pub fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Put problems in file order (stable: problems at one place keep their order); those with no
/// location come last.
pub fn sort_problems(problems: &mut [Problem]) {
    problems.sort_by_key(|p| p.location.map_or((usize::MAX, 0), |l| (l.line, l.column)));
}

/// Whether `text` that is not valid TOML starts as a JSON document does: `{`, or `[` followed
/// by `{` or `]` (a TOML table header such as `[router]`, `["router"]` or `[[devices]]` does
/// not).
fn looks_like_json(text: &str) -> bool {
    let mut rest = text.trim_start_matches('\u{feff}').trim_start();
    if rest.starts_with('{') {
        return true;
    }
    let Some(after) = rest.strip_prefix('[') else {
        return false;
    };
    rest = after.trim_start();
    rest.starts_with(['{', ']'])
}

/// Largest text file [`read_capped`] reads: 256 MiB, far above any topology, model,
/// placement, load statistics or bench file (a placement of a thousand-expert model is a few
/// MB), far below what reading `/dev/zero` by mistake would take before the process is killed.
pub const MAX_TEXT_FILE_BYTES: u64 = 256 << 20;

/// Reads `path` whole, refusing one larger than [`MAX_TEXT_FILE_BYTES`] with an error that
/// names it (a device such as `/dev/zero` given by mistake; a pipe is read up to the limit).
pub fn read_capped(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(MAX_TEXT_FILE_BYTES + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_TEXT_FILE_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "more than {} MiB: not a file of this kind (check the path)",
                MAX_TEXT_FILE_BYTES >> 20
            ),
        ));
    }
    Ok(bytes)
}

/// [`read_capped`] as UTF-8 text; `Err` holds the byte offset of the first byte that is not
/// UTF-8 where the bytes were read.
pub fn read_capped_text(path: &Path) -> std::io::Result<Result<String, usize>> {
    let bytes = read_capped(path)?;
    Ok(String::from_utf8(bytes).map_err(|e| e.utf8_error().valid_up_to()))
}

/// Read a whole file as UTF-8 text. A file that is read but is not UTF-8 is invalid (a problem
/// at the first bad byte), not an I/O error.
pub fn read_text(path: &Path) -> Result<String, FileError> {
    let bytes = read_capped(path).map_err(|source| FileError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    String::from_utf8(bytes).map_err(|e| {
        let good = e.utf8_error().valid_up_to();
        let text = String::from_utf8_lossy(&e.as_bytes()[..good]).into_owned();
        FileError::Invalid {
            path: path.to_path_buf(),
            problems: vec![Problem::new(
                Some(Location::of_offset(&text, good)),
                "",
                "the file is not UTF-8 text; save it as UTF-8",
            )],
        }
    })
}

/// Byte offsets of line starts, so that locating a problem costs a binary search rather than a
/// scan of the text (a file with tens of thousands of problems stays linear).
struct Lines {
    starts: Vec<usize>,
}

impl Lines {
    fn new(text: &str) -> Lines {
        let mut starts = vec![0];
        starts.extend(text.match_indices('\n').map(|(i, _)| i + 1));
        Lines { starts }
    }

    /// Same as [`Location::of_offset`].
    fn locate(&self, text: &str, offset: usize) -> Location {
        let mut offset = offset.min(text.len());
        while !text.is_char_boundary(offset) {
            offset -= 1;
        }
        let line = self.starts.partition_point(|&s| s <= offset);
        let start = self.starts[line - 1];
        let column = text[start..offset].chars().count() + 1;
        Location { line, column }
    }
}

/// Collects problems while validating one file.
pub(crate) struct Ctx<'a> {
    text: &'a str,
    lines: Lines,
    problems: Vec<Problem>,
    /// Every value in the document: its span, the item it belongs to and its key.
    index: Vec<(Range<usize>, String, String)>,
}

impl<'a> Ctx<'a> {
    pub(crate) fn new(text: &'a str) -> Ctx<'a> {
        Ctx {
            text,
            lines: Lines::new(text),
            problems: Vec::new(),
            index: Vec::new(),
        }
    }

    /// The location of byte `offset` of the text.
    pub(crate) fn locate(&self, offset: usize) -> Location {
        self.lines.locate(self.text, offset)
    }

    /// Report a problem located at `span` (when given).
    pub(crate) fn at(
        &mut self,
        span: Option<Range<usize>>,
        item: impl Into<String>,
        message: impl Into<String>,
    ) {
        let location = span.map(|s| self.locate(s.start));
        self.problems.push(Problem::new(location, item, message));
    }

    /// Report a problem with no single location.
    pub(crate) fn report(&mut self, item: impl Into<String>, message: impl Into<String>) {
        self.problems.push(Problem::new(None, item, message));
    }

    pub(crate) fn has_problems(&self) -> bool {
        !self.problems.is_empty()
    }

    /// The problems in file order (stable: problems at one place keep their order); those with
    /// no location come last.
    pub(crate) fn into_problems(mut self) -> Vec<Problem> {
        sort_problems(&mut self.problems);
        self.problems
    }

    /// Steps 1–3 of the module docs: parse, walk for unknown keys, deserialize into `R`.
    /// Returns `None` (with the problems recorded) when the text is not valid TOML or `R` cannot
    /// be deserialized from it.
    pub(crate) fn parse<R: for<'de> Deserialize<'de>>(&mut self, schema: &Schema) -> Option<R> {
        let doc = match DeTable::parse(self.text) {
            Ok(doc) => doc,
            Err(_) if looks_like_json(self.text) => {
                let msg = "this file looks like JSON; topology, model and placement files are \
                           TOML (the files in examples/ show the form)";
                self.at(Some(0..0), "", msg.to_owned());
                return None;
            }
            Err(e) => {
                self.at(
                    e.span(),
                    "",
                    format!("TOML syntax error: {}", e.message().trim()),
                );
                return None;
            }
        };
        if let Some(msg) = foreign_file(doc.get_ref(), schema) {
            self.at(Some(0..0), "top level", msg);
            return None;
        }
        let mut unknown = Vec::new();
        walk(doc.get_ref(), schema, "", self, &mut unknown);
        unknown.sort_by_key(|(start, _, _)| *start);
        for (start, item, msg) in unknown {
            self.at(Some(start..start), item, msg);
        }
        match R::deserialize(toml::de::Deserializer::from(doc)) {
            Ok(raw) => Some(raw),
            Err(e) => {
                let (item, key) = e
                    .span()
                    .and_then(|s| self.innermost(&s))
                    .unwrap_or_default();
                let msg = friendly_serde_message(e.message());
                let msg = out_of_range_message(&msg, &key).unwrap_or(msg);
                let msg = if key.is_empty() {
                    msg
                } else {
                    let msg = msg
                        .replace("[[key]]", &format!("[[{key}]]"))
                        .replace("key = [", &format!("{key} = ["));
                    format!("`{key}`: {msg}")
                };
                self.at(e.span(), item, msg);
                None
            }
        }
    }

    /// The item and key of the smallest indexed value containing `span`.
    fn innermost(&self, span: &Range<usize>) -> Option<(String, String)> {
        self.index
            .iter()
            .filter(|(s, _, _)| s.start <= span.start && span.end <= s.end)
            .min_by_key(|(s, _, _)| s.end - s.start)
            .map(|(_, item, key)| (item.clone(), key.clone()))
    }
}

/// An integer too large for 64 bits reaches serde as an i128 ("wrong type: integer `N` as
/// i128"); say that it is out of range instead (for a port: of 1-65535).
fn out_of_range_message(msg: &str, key: &str) -> Option<String> {
    let rest = msg.strip_prefix("wrong type: integer `")?;
    let (number, tail) = rest.split_once('`')?;
    if !(tail.starts_with(" as i128") || tail.starts_with(" as u128")) {
        return None;
    }
    Some(if key.ends_with("port") {
        format!("{number} is out of range for a port; use 1 to 65535")
    } else {
        format!("{number} is out of range; the value is far too large")
    })
}

/// A file of another kind given where this one was expected: most of its top-level keys are
/// unknown here and belong to that kind. Returns the one message that replaces the flood of
/// "unknown key" problems.
fn foreign_file(doc: &DeTable<'_>, schema: &Schema) -> Option<String> {
    let unknown: Vec<&str> = doc
        .iter()
        .map(|(k, _)| -> &str { k.get_ref() })
        .filter(|k| !schema.fields.contains(k))
        .collect();
    schema.foreign.iter().find_map(|f| {
        let theirs: Vec<&str> = unknown
            .iter()
            .copied()
            .filter(|k| f.keys.contains(k))
            .collect();
        (theirs.len() >= 2 && 2 * theirs.len() >= unknown.len()).then(|| {
            let shown: Vec<String> = theirs.iter().take(4).map(|k| format!("`{k}`")).collect();
            format!(
                "this looks like a {} (it has {}), not a {}; {}",
                f.what,
                shown.join(", "),
                schema.file,
                f.hint
            )
        })
    })
}

/// Make serde's type names readable for someone editing a TOML file.
fn friendly_serde_message(msg: &str) -> String {
    let mut m = msg.trim().to_owned();
    // "expected struct RawNode" names an internal type; say what the file needs instead.
    while let Some(at) = m.find("expected struct ") {
        let rest = &m[at + "expected struct ".len()..];
        let end = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        m = format!("{}expected a table{}", &m[..at], &rest[end..]);
    }
    if m.starts_with("invalid type: map, expected a sequence") {
        return "wrong type: a table, expected an array of tables; write [[key]] for each entry \
                (double brackets), or key = [ {...}, {...} ]"
            .to_owned();
    }
    m.replace("expected i64", "expected an integer")
        .replace("expected f64", "expected a number")
        .replace("expected a boolean", "expected true or false")
        .replace("expected a sequence", "expected an array")
        .replace("invalid type: ", "wrong type: ")
}

/// What keys a table may hold, and how to walk into the nested tables.
#[derive(Debug)]
pub(crate) struct Schema {
    /// Singular noun for the item (`node`, `device`, `NIC`); `""` for the document root.
    pub(crate) what: &'static str,
    /// The valid keys (from [`fields_of`]).
    pub(crate) fields: &'static [&'static str],
    /// A key whose string value names the item in messages (`name`, `device`).
    pub(crate) label_key: Option<&'static str>,
    /// Keys holding nested tables (or arrays of tables), with their schemas.
    pub(crate) children: Vec<(&'static str, Child)>,
    /// At the root: what kind of file this is (`topology file`).
    pub(crate) file: &'static str,
    /// At the root: the other kinds of file someone may pass here by mistake.
    pub(crate) foreign: Vec<Foreign>,
}

/// Another kind of file, recognized by its top-level keys.
#[derive(Debug)]
pub(crate) struct Foreign {
    /// `placement file`.
    pub(crate) what: &'static str,
    /// Its top-level keys.
    pub(crate) keys: &'static [&'static str],
    /// What to do instead (`pass it with --placement`).
    pub(crate) hint: &'static str,
}

/// How a nested key is shaped.
#[derive(Debug)]
pub(crate) enum Child {
    /// A table, or an array of tables, each following the schema.
    Table(Schema),
    /// A table whose keys are free names and whose values follow the schema
    /// (e.g. `[device_types.mi300x]`).
    Map(Schema),
}

impl Schema {
    pub(crate) fn new(
        what: &'static str,
        fields: &'static [&'static str],
        label_key: Option<&'static str>,
    ) -> Schema {
        Schema {
            what,
            fields,
            label_key,
            children: Vec::new(),
            file: "",
            foreign: Vec::new(),
        }
    }

    /// The root schema of a kind of file (`topology file`), and the other kinds of file
    /// (`Foreign`) to recognize when one is passed here by mistake.
    pub(crate) fn root(mut self, file: &'static str, foreign: Vec<Foreign>) -> Schema {
        self.file = file;
        self.foreign = foreign;
        self
    }

    pub(crate) fn table(mut self, key: &'static str, child: Schema) -> Schema {
        debug_assert!(self.fields.contains(&key), "{key} not a field");
        self.children.push((key, Child::Table(child)));
        self
    }

    pub(crate) fn map(mut self, key: &'static str, child: Schema) -> Schema {
        debug_assert!(self.fields.contains(&key), "{key} not a field");
        self.children.push((key, Child::Map(child)));
        self
    }

    fn child(&self, key: &str) -> Option<&Child> {
        self.children
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, c)| c)
    }
}

fn item_label(
    parent: &str,
    schema: &Schema,
    table: &DeTable<'_>,
    name: Option<&str>,
    index: Option<usize>,
) -> String {
    let labelled = schema
        .label_key
        .and_then(|k| table.get(k))
        .and_then(|v| v.get_ref().as_str().map(str::to_owned));
    let base = match (name, labelled, index) {
        (Some(n), _, _) => format!("{} \"{n}\"", schema.what),
        (None, Some(l), _) => format!("{} \"{l}\"", schema.what),
        (None, None, Some(i)) => format!("{} #{}", schema.what, i + 1),
        (None, None, None) => schema.what.to_owned(),
    };
    match (parent.is_empty(), base.is_empty()) {
        (true, _) => base,
        (false, true) => parent.to_owned(),
        (false, false) => format!("{parent} {base}"),
    }
}

fn walk(
    table: &DeTable<'_>,
    schema: &Schema,
    label: &str,
    ctx: &mut Ctx<'_>,
    unknown: &mut Vec<(usize, String, String)>,
) {
    let item = if label.is_empty() { "top level" } else { label };
    for (key, value) in table.iter() {
        let k: &str = key.get_ref();
        ctx.index
            .push((value.span(), item.to_owned(), k.to_owned()));
        if !schema.fields.contains(&k) {
            unknown.push((
                key.span().start,
                item.to_owned(),
                unknown_key_message(k, schema.fields),
            ));
            continue;
        }
        match (schema.child(k), value.get_ref()) {
            (Some(Child::Table(s)), DeValue::Table(t)) => {
                let l = item_label(label, s, t, None, None);
                walk(t, s, &l, ctx, unknown);
            }
            (Some(Child::Table(s)), DeValue::Array(a)) => {
                for (i, v) in a.iter().enumerate() {
                    if let DeValue::Table(t) = v.get_ref() {
                        ctx.index.push((v.span(), item.to_owned(), k.to_owned()));
                        let l = item_label(label, s, t, None, Some(i));
                        walk(t, s, &l, ctx, unknown);
                    }
                }
            }
            (Some(Child::Map(s)), DeValue::Table(t)) => {
                for (name, v) in t.iter() {
                    if let DeValue::Table(inner) = v.get_ref() {
                        let l = item_label(label, s, inner, Some(name.get_ref()), None);
                        walk(inner, s, &l, ctx, unknown);
                    }
                }
            }
            _ => {}
        }
    }
}

/// `unknown key "x"; did you mean "y"?`, or the list of valid keys when nothing is close.
pub(crate) fn unknown_key_message(key: &str, valid: &[&str]) -> String {
    match nearest(key, valid.iter().copied()) {
        Some(s) => format!("unknown key \"{key}\"; did you mean \"{s}\"?"),
        None => format!(
            "unknown key \"{key}\"; valid keys here: {}",
            valid.join(", ")
        ),
    }
}

/// The candidate closest to `word` when it is close enough to be a plausible typo.
pub fn nearest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let lower = word.to_ascii_lowercase();
    candidates
        .into_iter()
        .map(|c| {
            let d = strsim::damerau_levenshtein(&lower, &c.to_ascii_lowercase());
            let jw = strsim::jaro_winkler(&lower, &c.to_ascii_lowercase());
            (c, d, jw)
        })
        .filter(|(c, d, jw)| {
            let limit = (c.chars().count().max(word.chars().count()) / 3).max(2);
            *d <= limit || *jw >= 0.88
        })
        .min_by(|a, b| a.1.cmp(&b.1).then(b.2.total_cmp(&a.2)))
        .map(|(c, _, _)| c)
}

/// The field names a serde-derived struct accepts (including renames), without deserializing.
pub(crate) fn fields_of<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
    struct Grab<'a>(&'a mut &'static [&'static str]);
    #[derive(Debug)]
    struct Stop;
    impl fmt::Display for Stop {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("field introspection")
        }
    }
    impl std::error::Error for Stop {}
    impl de::Error for Stop {
        fn custom<M: fmt::Display>(_: M) -> Self {
            Stop
        }
    }
    impl<'de> de::Deserializer<'de> for Grab<'_> {
        type Error = Stop;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
            Err(Stop)
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Stop> {
            *self.0 = fields;
            Err(Stop)
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
            option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
            ignored_any
        }
    }
    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(Grab(&mut fields));
    fields
}

/// A field of a raw struct: the value with its span in the file.
pub(crate) type Field<T> = Option<Spanned<T>>;

/// Split an optional spanned value into the value and its span.
pub(crate) fn split<T: Clone>(f: &Field<T>) -> (Option<T>, Option<Range<usize>>) {
    match f {
        Some(s) => (Some(s.get_ref().clone()), Some(s.span())),
        None => (None, None),
    }
}

/// The span of an optional spanned value.
pub(crate) fn span_of<T>(f: &Field<T>) -> Option<Range<usize>> {
    f.as_ref().map(Spanned::span)
}

/// An optional free-text value (`description`), empty when absent.
pub(crate) fn text_or_default(f: &Field<String>) -> String {
    f.as_ref().map(|d| d.get_ref().clone()).unwrap_or_default()
}

/// The `format = N` check every file starts with, reported under "top level". Returns false
/// when a format is given and is not `expected` (absent: reported, but true).
pub(crate) fn check_format(ctx: &mut Ctx<'_>, f: &Field<i64>, file: &str, expected: i64) -> bool {
    match split(f) {
        (None, _) => {
            ctx.at(
                None,
                "top level",
                "missing `format`; add `format = 1` at the top of the file",
            );
            true
        }
        (Some(v), _) if v == expected => true,
        (Some(v), span) => {
            ctx.at(
                span,
                "top level",
                format!("unsupported format {v}; this build reads {file} format {expected}"),
            );
            false
        }
    }
}

/// `did you mean "X"?` for the candidate nearest to `word`, else what `fallback` says.
pub(crate) fn did_you_mean<'a>(
    word: &str,
    candidates: impl IntoIterator<Item = &'a str>,
    fallback: impl FnOnce() -> String,
) -> String {
    match nearest(word, candidates) {
        Some(n) => format!("did you mean \"{n}\"?"),
        None => fallback(),
    }
}

/// A byte count written as an integer or a human string like `"180 GiB"` / `"64 GB"`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum RawBytes {
    /// A plain integer of bytes (may be negative in the file; validation rejects that).
    Int(i64),
    /// A string with a unit.
    Text(String),
}

impl<'de> Deserialize<'de> for RawBytes {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = RawBytes;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a byte count: an integer or a string like \"180 GiB\" or \"64 GB\"")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<RawBytes, E> {
                Ok(RawBytes::Int(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<RawBytes, E> {
                Ok(RawBytes::Int(i64::try_from(v).unwrap_or(i64::MAX)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawBytes, E> {
                Ok(RawBytes::Text(v.to_owned()))
            }
        }
        d.deserialize_any(V)
    }
}

impl RawBytes {
    /// The byte count and the units it was written in (a plain integer: decimal).
    pub(crate) fn bytes_unit(&self) -> Result<(u64, crate::units::SizeUnit), String> {
        match self {
            RawBytes::Int(v) if *v < 0 => Err(format!("{v} is negative; give a byte count")),
            RawBytes::Int(v) => Ok((*v as u64, crate::units::SizeUnit::Decimal)),
            RawBytes::Text(s) => crate::units::parse_bytes_unit(s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_become_line_and_column() {
        let text = "a = 1\nbé = 2\n\nc = 3";
        assert_eq!(
            Location::of_offset(text, 0),
            Location { line: 1, column: 1 }
        );
        assert_eq!(
            Location::of_offset(text, 6),
            Location { line: 2, column: 1 }
        );
        // 'é' is two bytes but one column
        let eq = text.find("= 2").unwrap();
        assert_eq!(
            Location::of_offset(text, eq),
            Location { line: 2, column: 4 }
        );
        let c = text.find('c').unwrap();
        assert_eq!(
            Location::of_offset(text, c),
            Location { line: 4, column: 1 }
        );
        // past the end clamps
        assert_eq!(Location::of_offset(text, 999).line(), 4);
    }

    #[test]
    fn nearest_suggests_typos_only() {
        let keys = ["name", "address", "control_port", "data_port", "devices"];
        assert_eq!(nearest("nmae", keys), Some("name"));
        assert_eq!(nearest("adress", keys), Some("address"));
        assert_eq!(nearest("controlport", keys), Some("control_port"));
        assert_eq!(nearest("Devices", keys), Some("devices"));
        assert_eq!(nearest("zzzzzzzzzz", keys), None);
    }

    #[test]
    fn field_introspection_matches_serde() {
        #[derive(Deserialize)]
        #[allow(dead_code)]
        struct S {
            a: u32,
            #[serde(rename = "type")]
            kind: String,
        }
        assert_eq!(fields_of::<S>(), &["a", "type"]);
    }
}
