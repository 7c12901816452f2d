//! Plain-text tables for CLI reports.
//!
//! Why this exists: `validate` and `models` print tables whose columns must line up however long
//! the device ids or model names are; one small helper keeps the formatting in one place.

/// A column: header and alignment.
pub(crate) struct Col {
    pub(crate) header: &'static str,
    pub(crate) right: bool,
}

/// A left-aligned column.
pub(crate) fn left(header: &'static str) -> Col {
    Col {
        header,
        right: false,
    }
}

/// A right-aligned (numeric) column.
pub(crate) fn right(header: &'static str) -> Col {
    Col {
        header,
        right: true,
    }
}

/// Render rows under headers, columns separated by two spaces, trailing spaces trimmed.
pub(crate) fn render(cols: &[Col], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = cols.iter().map(|c| c.header.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (i, (cell, col)) in cells.iter().zip(cols).enumerate() {
            if i > 0 {
                s.push_str("  ");
            }
            let pad = widths[i].saturating_sub(cell.chars().count());
            if col.right {
                s.push_str(&" ".repeat(pad));
                s.push_str(cell);
            } else {
                s.push_str(cell);
                s.push_str(&" ".repeat(pad));
            }
        }
        s.trim_end().to_owned()
    };
    let mut out = line(cols.iter().map(|c| c.header).collect());
    for row in rows {
        out.push('\n');
        out.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_line_up() {
        let t = render(
            &[left("name"), right("n")],
            &[
                vec!["a".into(), "1".into()],
                vec!["longer".into(), "100".into()],
            ],
        );
        assert_eq!(t, "name      n\na         1\nlonger  100");
    }
}
